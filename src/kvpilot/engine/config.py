"""Engine configuration: one dataclass, built from the CLI or keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvpilot.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Knobs of the step loop and the KV pool.

    ``max_num_batched_tokens`` is the token budget of one step (decodes count one each);
    ``max_prefill_chunk`` caps one sequence's prefill chunk. Monolithic prefill is
    ``chunked_prefill=False``: a prompt is computed in one step whatever its length.
    New work is admitted only while device KV usage (blocks held, not counting cached
    blocks that could be evicted) is below ``tau_high``.

    ``poison_freed_blocks`` overwrites every KV block returned to a free list (device and host)
    with NaN, so a missed copy, a wrong slot or a stale block shows up as NaN or wrong
    output instead of passing silently; the test suite runs with it on.
    """

    block_size: int = 16
    kv_blocks: int | None = None
    kv_memory_bytes: int | None = None
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int = 512
    max_num_seqs: int = 128
    chunked_prefill: bool = True
    tau_high: float = 0.9
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    dtype: str = "auto"  # bfloat16 on CUDA, float32 on CPU
    device: str = "cpu"
    attention: str = "auto"  # auto, torch, cpu, triton (kvpilot.model.attention)
    gpu_memory_utilization: float = 0.9  # sizes the KV pool when no kv_blocks/kv_memory_bytes
    cuda_graphs: bool = True
    seed: int = 0
    # Tiers and pauses: a host pool (blocks, or bytes), a disk tier in a folder, the policy.
    host_kv_blocks: int | None = None
    host_memory_bytes: int | None = None
    disk_dir: str | None = None
    disk_kv_blocks: int = 4096
    pause_policy: str = "breakeven"
    pause_ttl_s: float = 10.0
    default_tool_wait_s: float = 1.0
    prefetch: bool = True
    poison_freed_blocks: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1 or self.max_prefill_chunk < 1:
            raise ConfigError("max_num_batched_tokens and max_prefill_chunk must be positive")
        if not 0.0 < self.tau_high <= 1.0:
            raise ConfigError(f"tau_high must be in (0, 1], got {self.tau_high}")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ConfigError("kv_blocks must be positive")
        if (self.host_kv_blocks or 0) < 0 or (self.host_memory_bytes or 0) < 0:
            raise ConfigError("host_kv_blocks and host_memory_bytes must not be negative")
        if self.disk_kv_blocks < 1:
            raise ConfigError("disk_kv_blocks must be positive")
        from kvpilot.policy.pause import POLICY_NAMES

        if self.pause_policy not in POLICY_NAMES:
            raise ConfigError(
                f"unknown pause policy {self.pause_policy!r}; choose one of "
                f"{', '.join(POLICY_NAMES)}"
            )
        if self.pause_ttl_s < 0 or self.default_tool_wait_s < 0:
            raise ConfigError("pause_ttl_s and default_tool_wait_s must not be negative")

    @property
    def has_tiers(self) -> bool:
        return bool(self.host_kv_blocks or self.host_memory_bytes or self.disk_dir)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; known: {sorted(names)}")
        return cls(**kwargs)  # type: ignore[arg-type]
