"""Engine configuration: one frozen dataclass per component, and the flat names people use.

`EngineConfig` holds a `SchedulerConfig` (the step's token budget and admission), a
`PauseConfig` (what a pause does) and a `RunnerConfig` (the KV pool and the executor, with
its `TierConfig`), plus the engine's own context cap and seed. Keyword callers and the CLI
use flat names (``kv_blocks=64, tau_high=0.8, pause_policy="drop"``): `FLAT_OPTIONS` maps
each one onto its component, in this one place.

A `RunnerConfig` field left at None means "whatever the executor was built with"; a field
that is set must be honoured, so the engine refuses a value its executor does not have
(block size, pool size) and builders refuse what they cannot build (the simulator has no
dtype or device).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpilot.errors import ConfigError
from kvpilot.policy.pause import POLICY_NAMES

if TYPE_CHECKING:
    from kvpilot.engine.executor import Executor, TierTransport

DEFAULT_BLOCK_SIZE = 16
DEFAULT_DISK_KV_BLOCKS = 4096


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The step's token budget and admission.

    ``max_num_batched_tokens`` is the token budget of one step (decodes count one each);
    ``max_prefill_chunk`` caps one sequence's prefill chunk. Monolithic prefill is
    ``chunked_prefill=False``: a prompt is computed in one step whatever its length.
    New work is admitted only while device KV usage (blocks held, not counting cached
    blocks that could be evicted) is below ``tau_high``. A request whose admission would
    evict a paused session's state that is back sooner than it would take to recompute
    waits for it, at most ``max_defer_s`` (0: never; `kvpilot.engine.admission`).
    """

    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int = 512
    max_num_seqs: int = 128
    chunked_prefill: bool = True
    tau_high: float = 0.9
    enable_prefix_caching: bool = True
    max_defer_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_defer_s < float("inf"):
            raise ConfigError(f"max_defer_s must be a finite number >= 0, got {self.max_defer_s}")
        if self.max_num_batched_tokens < 1 or self.max_prefill_chunk < 1:
            raise ConfigError("max_num_batched_tokens and max_prefill_chunk must be positive")
        if not 0.0 < self.tau_high <= 1.0:
            raise ConfigError(f"tau_high must be in (0, 1], got {self.tau_high}")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be positive")


@dataclass(frozen=True, slots=True)
class PauseConfig:
    """What a pause does: the policy (`kvpilot.policy.pause`), the ttl policy's lease, the
    wait assumed before any was observed, and whether offloaded state is prefetched."""

    policy: str = "breakeven"
    ttl_s: float = 10.0
    default_tool_wait_s: float = 1.0
    prefetch: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ConfigError(
                f"unknown pause policy {self.policy!r} (--policy); choose one of "
                f"{', '.join(POLICY_NAMES)}"
            )
        if self.ttl_s < 0 or self.default_tool_wait_s < 0:
            raise ConfigError("pause_ttl_s and default_tool_wait_s must not be negative")


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Tiers below the device: a host pool (in blocks, or bytes) and a disk tier in a folder
    of ``disk_kv_blocks`` slots (default 4096)."""

    host_kv_blocks: int | None = None
    host_memory_bytes: int | None = None
    disk_dir: str | None = None
    disk_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        if (self.host_kv_blocks or 0) < 0 or (self.host_memory_bytes or 0) < 0:
            raise ConfigError("host_kv_blocks and host_memory_bytes must not be negative")
        if self.host_kv_blocks is not None and self.host_memory_bytes is not None:
            raise ConfigError("give host_kv_blocks or host_memory_bytes (--host-memory), not both")
        if self.disk_kv_blocks is not None and self.disk_kv_blocks < 1:
            raise ConfigError("disk_kv_blocks (--disk-blocks) must be positive")
        if self.disk_kv_blocks is not None and self.disk_dir is None:
            raise ConfigError(
                "disk_kv_blocks (--disk-blocks) sizes the disk tier: give disk_dir (--disk-dir) too"
            )

    @property
    def has_host(self) -> bool:
        return bool(self.host_kv_blocks or self.host_memory_bytes)

    @property
    def any(self) -> bool:
        return self.has_host or self.disk_dir is not None

    @property
    def disk_slots(self) -> int:
        return self.disk_kv_blocks or DEFAULT_DISK_KV_BLOCKS


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """The KV pool and the executor: block size, device pool (blocks, or bytes), dtype,
    device, attention backend, and the tiers below the device. None: the executor's own.

    A model builder (`kvpilot.model.build`) reads ``dtype`` ("auto": bfloat16 on CUDA,
    float32 on CPU), ``attention`` ("auto", "torch", "cpu", "triton"), and sizes the pool
    from ``gpu_memory_utilization`` when neither ``kv_blocks`` nor ``kv_memory_bytes`` is
    given; ``cuda_graphs`` captures decode-only steps on CUDA.

    ``tensor_parallel_size`` shards the model over that many ranks (`kvpilot.model.parallel`:
    worker processes, each with its KV heads' share of every block; ``kv_memory_bytes`` is
    then per rank).

    ``poison_freed_blocks`` overwrites every KV block returned to a free list (device and host)
    with NaN, so a missed copy, a wrong slot or a stale block shows up as NaN or wrong
    output instead of passing silently; the test suite runs with it on.

    ``release_window_blocks`` (models with sliding-window layers): keep those layers' KV in
    a pool of their own (``window_kv_blocks`` blocks, default as many as the main pool) and
    release the blocks wholly outside the window (`kvpilot.memory.window`); False keeps
    every layer's KV of every block.
    """

    block_size: int | None = None
    kv_blocks: int | None = None
    kv_memory_bytes: int | None = None
    dtype: str | None = None
    device: str | None = None
    attention: str | None = None
    gpu_memory_utilization: float = 0.9
    cuda_graphs: bool = True
    tensor_parallel_size: int = 1
    poison_freed_blocks: bool = False
    release_window_blocks: bool = True
    window_kv_blocks: int | None = None
    tiers: TierConfig = field(default_factory=TierConfig)

    def __post_init__(self) -> None:
        bs = self.block_size
        if bs is not None and (bs < 1 or bs & (bs - 1)):
            raise ConfigError(f"block_size must be a power of two, got {bs}")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ConfigError("kv_blocks must be positive")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes < 1:
            raise ConfigError("kv_memory_bytes must be positive")
        if self.kv_blocks is not None and self.kv_memory_bytes is not None:
            raise ConfigError(
                "give kv_blocks (--kv-blocks) or kv_memory_bytes (--kv-memory), not both"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.window_kv_blocks is not None and self.window_kv_blocks < 2:
            raise ConfigError(
                f"window_kv_blocks must be >= 2 (one is the null block), got "
                f"{self.window_kv_blocks}"
            )
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"tensor_parallel_size (--tp) must be >= 1, got {self.tensor_parallel_size}"
            )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every component's configuration, and the engine's own context cap and seed."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    pause: PauseConfig = field(default_factory=PauseConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    max_model_len: int | None = None
    seed: int = 0

    @classmethod
    def from_kwargs(cls, **options: Any) -> EngineConfig:
        """A config from flat names (`FLAT_OPTIONS`), e.g. ``kv_blocks=64, tau_high=0.8``."""
        return cls().replace(**options)

    def replace(self, **options: Any) -> EngineConfig:
        """This config with some flat-named options changed; unknown names are a ConfigError."""
        unknown = sorted(set(options) - set(FLAT_OPTIONS))
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; known: {sorted(FLAT_OPTIONS)}")
        changes: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            path, attr = FLAT_OPTIONS[name]
            changes.setdefault(path, {})[attr] = value
        return _replace_at(self, "", changes)

    def flat(self, *, changed_only: bool = False) -> dict[str, Any]:
        """The config under its flat names (only those that differ from the defaults)."""
        default = EngineConfig() if changed_only else None
        out = {}
        for name, (path, attr) in FLAT_OPTIONS.items():
            value = getattr(_component(self, path), attr)
            if default is None or value != getattr(_component(default, path), attr):
                out[name] = value
        return out


# flat name -> (component path, field): the one place the flat keyword API is mapped.
FLAT_OPTIONS: Mapping[str, tuple[str, str]] = {
    **{f.name: ("scheduler", f.name) for f in dataclasses.fields(SchedulerConfig)},
    "pause_policy": ("pause", "policy"),
    "pause_ttl_s": ("pause", "ttl_s"),
    "default_tool_wait_s": ("pause", "default_tool_wait_s"),
    "prefetch": ("pause", "prefetch"),
    **{f.name: ("runner", f.name) for f in dataclasses.fields(RunnerConfig) if f.name != "tiers"},
    **{f.name: ("runner.tiers", f.name) for f in dataclasses.fields(TierConfig)},
    "max_model_len": ("", "max_model_len"),
    "seed": ("", "seed"),
}


def check_honoured(
    runner: RunnerConfig, executor: Executor, transport: TierTransport | None, disk: object
) -> None:
    """ConfigError for a `RunnerConfig` field the executor (or the tiers given) does not have.

    The engine sees the block size and pool size of its executor, and whether it was given a
    host tier and a disk tier; what else a builder was asked for, it builds or refuses.
    """
    problems = []
    if runner.block_size is not None and runner.block_size != executor.block_size:
        problems.append(f"block_size {runner.block_size} (the executor uses {executor.block_size})")
    if runner.kv_blocks is not None and runner.kv_blocks != executor.num_blocks:
        problems.append(f"kv_blocks {runner.kv_blocks} (the executor has {executor.num_blocks})")
    tiers = runner.tiers
    if tiers.has_host and (transport is None or transport.num_host_blocks < 1):
        problems.append("a host tier (no tier transport with host blocks was given)")
    if tiers.disk_dir is not None and disk is None:
        problems.append(f"a disk tier in {tiers.disk_dir} (no disk store was given)")
    if problems:
        raise ConfigError(
            "the engine cannot honour " + "; ".join(problems) + ": leave these unset, or build "
            "the engine with Engine.from_pretrained (kvpilot.model.build) or the simulator"
        )


def _component(config: Any, path: str) -> Any:
    for part in filter(None, path.split(".")):
        config = getattr(config, part)
    return config


def _replace_at(config: Any, path: str, changes: dict[str, dict[str, Any]]) -> Any:
    """``config`` (the component at ``path``) with ``changes`` applied to it and below it."""
    own = dict(changes.get(path, {}))
    for f in dataclasses.fields(config):
        sub = f"{path}.{f.name}" if path else f.name
        if any(p == sub or p.startswith(sub + ".") for p in changes):
            own[f.name] = _replace_at(getattr(config, f.name), sub, changes)
    if not own:
        return config
    try:
        return dataclasses.replace(config, **own)
    except TypeError as exc:
        raise ConfigError(f"bad engine option: {exc}") from exc
