"""Assemble a simulation: model geometry + node -> cost model, KV pool, engine; then run it.

The simulated engine is a normal `kvpilot.engine.Engine` whose executor is a
`SimulatedRunner` on a `VirtualClock`. Its KV pool is what `kvpilot plan` leaves on one
device of the TP group (HBM minus weights minus reserve, in blocks), unless ``kv_blocks``
overrides it. Its host tier is a `SimulatedTransport` over each device's host link, holding
``host_kv_bytes_per_device`` (default: half the host memory the node gives each device; 0:
no host tier), so pause policies can offload. The simulator runs one model replica (one TP
group); a node holding several replicas serves that many times the simulated throughput.
Without ``tp`` the group is what `kvpilot plan` picks (the smallest TP degree whose weights
leave room for one sequence of ``max_model_len``), and ``max_model_len`` defaults to the
model's own context limit (a longer one is clamped to it, with a warning).

Hybrid models: the cost model reads sliding-window layers' KV only within their window,
and the engine keeps those layers' KV in a window pool of its own, releasing blocks wholly
outside the window, as the real engine does; the two pools are split by the plan's
per-layer arithmetic (`kvpilot.sim.pools`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.engine.clock import VirtualClock
from kvpilot.engine.config import DEFAULT_BLOCK_SIZE, EngineConfig
from kvpilot.engine.engine import Engine
from kvpilot.errors import ConfigError
from kvpilot.sim.cost_model import RooflineCostModel, StepCostModel
from kvpilot.sim.disk import SimulatedDiskStore
from kvpilot.sim.drivers import AgentDriver, ReplayDriver
from kvpilot.sim.policies import apply_policy, resolve_policy
from kvpilot.sim.pools import host_kv_bytes, pool_warnings, sim_pools
from kvpilot.sim.profile import CalibratedCostModel, StepProfile
from kvpilot.sim.replay import ReplaySession
from kvpilot.sim.report import SimResult
from kvpilot.sim.runner import SimulatedRunner
from kvpilot.sim.simulator import Simulator
from kvpilot.sim.transport import SimulatedTransport
from kvpilot.sim.window_runner import WindowedSimulatedRunner
from kvpilot.sim.workload import WorkloadConfig
from kvpilot.sizing.capacity import (
    DEFAULT_RESERVE_BYTES_PER_DEVICE,
    block_sizing,
    default_tp,
    memory_budget,
)
from kvpilot.sizing.geometry import ModelGeometry, resolve_geometry
from kvpilot.sizing.hardware import Node, parse_node
from kvpilot.sizing.plan import dtype_warnings

DEFAULT_MAX_MODEL_LEN = 131072


@dataclass(frozen=True, slots=True)
class SimSetup:
    """What to simulate: the model, the node, the engine knobs and the run length.

    ``kv_dtype``/``weights_dtype`` override the model's; ``max_model_len`` None is the
    model's context limit; ``tp`` None is the plan's default (see the module docstring).
    """

    model: str = "llama-3-70b"
    node: str = "8xh100"
    tp: int | None = None
    kv_dtype: str | None = None
    weights_dtype: str | None = None
    kv_blocks: int | None = None
    reserve_bytes_per_device: float = DEFAULT_RESERVE_BYTES_PER_DEVICE
    mfu: float = 0.5
    hbm_efficiency: float = 0.8
    step_overhead_s: float = 1e-3
    profile: Path | None = None
    host_kv_bytes_per_device: float | None = None
    disk_kv_bytes_per_device: float = 0.0  # 0: no disk tier (`kvpilot.sim.disk`)
    engine: EngineConfig = dataclasses.field(
        default_factory=lambda: EngineConfig.from_kwargs(
            max_num_seqs=256, max_num_batched_tokens=2048
        )
    )
    max_model_len: int | None = None
    duration_s: float = 3600.0
    sample_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.duration_s <= 0:
            raise ConfigError(f"--duration must be positive, got {self.duration_s}")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ConfigError("--kv-blocks must be positive")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("--max-model-len must be at least 2")
        if self.host_kv_bytes_per_device is not None and self.host_kv_bytes_per_device < 0:
            raise ConfigError("--host-memory must not be negative")
        if self.disk_kv_bytes_per_device < 0:
            raise ConfigError("the simulated disk tier's size must not be negative")
        runner = self.engine.runner
        refused = {
            "kv_blocks": "give SimSetup.kv_blocks (--kv-blocks)",
            "kv_memory_bytes": "the pool is what the plan leaves, or SimSetup.kv_blocks",
            "dtype": "the model geometry sets the KV dtype",
            "device": "the node sets the device",
            "attention": "the cost model has no attention backends",
        }
        for name, instead in refused.items():
            if getattr(runner, name) is not None:
                raise ConfigError(f"the simulator cannot honour runner {name}: {instead}")
        tiers = runner.tiers
        if tiers.disk_dir is not None:
            raise ConfigError(
                "the simulator keeps no files: size its disk tier with "
                "SimSetup.disk_kv_bytes_per_device, and leave disk_dir unset"
            )
        if tiers.has_host:
            raise ConfigError(
                "the simulator sizes its host tier per device: give "
                "SimSetup.host_kv_bytes_per_device (--host-memory), not the runner's tiers"
            )

    def geometry(self) -> ModelGeometry:
        return resolve_geometry(self.model, self.kv_dtype, self.weights_dtype)

    def parsed_node(self) -> Node:
        return parse_node(self.node)

    def model_len(self) -> int:
        """The engine's context length: ``max_model_len`` within the model's limit."""
        if self.profile is not None:
            measured = StepProfile.load(self.profile).max_model_len
            return self.max_model_len or measured or DEFAULT_MAX_MODEL_LEN
        limit = self.geometry().max_context_tokens
        wanted = self.max_model_len or limit or DEFAULT_MAX_MODEL_LEN
        return min(wanted, limit) if limit else wanted

    def tp_degree(self) -> int:
        if self.tp is not None:
            return self.tp
        g, node = self.geometry(), self.parsed_node()
        return default_tp(g, node, self.model_len(), self.reserve_bytes_per_device)[0]

    def warnings(self) -> tuple[str, ...]:
        """What was clamped or assumed that a user should know."""
        if self.profile is not None:
            return ()
        g = self.geometry()
        out: list[str] = []
        limit = g.max_context_tokens
        if self.max_model_len and limit and self.max_model_len > limit:
            out.append(
                f"--max-model-len {self.max_model_len:,} exceeds {g.name}'s limit of "
                f"{limit:,} tokens (max_position_embeddings): simulated at {limit:,}"
            )
        out.extend(dtype_warnings(g))
        out.extend(pool_warnings(self))
        return tuple(out)

    def block_size(self) -> int:
        return self.engine.runner.block_size or DEFAULT_BLOCK_SIZE


def kv_pool_blocks(
    geometry: ModelGeometry,
    node: Node,
    tp: int,
    block_size: int = 16,
    reserve_bytes_per_device: float = DEFAULT_RESERVE_BYTES_PER_DEVICE,
) -> int:
    """Blocks of one device's KV pool (every device of the group holds its share of each)."""
    budget = memory_budget(geometry, node, tp, reserve_bytes_per_device)
    row = block_sizing(budget.pool_bytes_per_device, geometry.bytes_per_token(tp), block_size, 0)
    return row.num_blocks


def make_transport(
    setup: SimSetup, clock: VirtualClock, block_bytes: int
) -> SimulatedTransport | None:
    """The host tier over each device's host link, holding main-pool blocks of
    ``block_bytes``, or None (no tier, or a measured profile)."""
    host_bytes = host_kv_bytes(setup)
    accel = setup.parsed_node().accelerator
    blocks = int(host_bytes // block_bytes) if host_bytes and block_bytes else 0
    if blocks < 1:
        return None
    return SimulatedTransport(
        clock,
        num_host_blocks=blocks,
        block_bytes=block_bytes,
        link_bytes_per_s=accel.host_link_bw_bytes_s,
    )


def make_disk(setup: SimSetup, clock: VirtualClock, block_bytes: int) -> SimulatedDiskStore | None:
    """The node's NVMe as a disk tier, each device's share of it, or None (size 0)."""
    slots = int(setup.disk_kv_bytes_per_device // block_bytes)
    if slots < 1:
        return None
    share = setup.parsed_node().nvme_bw_bytes_s / setup.tp_degree()
    return SimulatedDiskStore(
        clock,
        num_slots=slots,
        block_bytes=block_bytes,
        read_bytes_per_s=share,
        write_bytes_per_s=share,
    )


def make_cost_model(setup: SimSetup) -> StepCostModel:
    block = setup.block_size()
    if setup.profile is not None:
        profile = StepProfile.load(setup.profile)
        if profile.block_size != block:
            raise ConfigError(
                f"profile {setup.profile} was measured at block size {profile.block_size}, "
                f"the engine uses {block}"
            )
        return CalibratedCostModel(profile)
    return RooflineCostModel(
        setup.geometry(),
        setup.parsed_node(),
        setup.tp_degree(),
        mfu=setup.mfu,
        hbm_efficiency=setup.hbm_efficiency,
        step_overhead_s=setup.step_overhead_s,
        block_size=block,
    )


def build_engine(
    setup: SimSetup, vocab_size: int, policy: str = "default"
) -> tuple[Engine, str | None]:
    """A simulated engine for ``setup`` under ``policy``, and the policy's note (if any)."""
    config, note = apply_policy(resolve_policy(policy), setup.engine)
    cost = make_cost_model(setup)
    pools = sim_pools(setup)
    clock = VirtualClock()
    transport = make_transport(setup, clock, pools.main_block_bytes)
    block_size = setup.block_size()
    runner: SimulatedRunner
    if pools.window is None:
        runner = SimulatedRunner(
            cost, clock, num_blocks=pools.main_blocks, block_size=block_size, vocab_size=vocab_size
        )
    else:
        runner = WindowedSimulatedRunner(
            cost,
            clock,
            pools.window,
            num_blocks=pools.main_blocks,
            block_size=block_size,
            vocab_size=vocab_size,
        )
    disk = make_disk(setup, clock, pools.main_block_bytes) if transport is not None else None
    engine = Engine(
        runner,
        config,
        tokenizer=None,
        vocab_size=vocab_size,
        max_model_len=setup.model_len(),
        clock=clock,
        transport=transport,
        disk=disk,  # type: ignore[arg-type]
    )
    return engine, note


Workload = WorkloadConfig | Sequence[ReplaySession]


def run_simulation(
    setup: SimSetup,
    workload: Workload,
    *,
    policy: str = "default",
    time_scale: float = 1.0,
    vocab_size: int | None = None,
    on_progress: Callable[[float], None] | None = None,
) -> SimResult:
    """Simulate ``workload`` (agent config, or replay sessions) for ``setup.duration_s``."""
    vocab = workload.vocab_size if isinstance(workload, WorkloadConfig) else vocab_size or 32000
    engine, note = build_engine(setup, vocab, policy)
    sim = Simulator(
        engine,
        duration_s=setup.duration_s,
        sample_interval_s=setup.sample_interval_s,
        on_progress=on_progress,
    )
    if isinstance(workload, WorkloadConfig):
        driver: AgentDriver | ReplayDriver = AgentDriver(workload, engine.max_model_len)
    else:
        driver = ReplayDriver(list(workload), time_scale)
    sim.run(driver)
    if setup.profile is not None:
        assert isinstance(engine.executor, SimulatedRunner)
        profiled = engine.executor.cost
        assert isinstance(profiled, CalibratedCostModel)
        model, node = profiled.profile.model, f"calibrated profile ({profiled.profile.device})"
        tp, replicas = 1, 1
    else:
        node_obj = setup.parsed_node()
        tp = setup.tp_degree()
        model, node, replicas = setup.geometry().name, node_obj.name, node_obj.count // tp
    runner = engine.executor
    assert isinstance(runner, SimulatedRunner)
    return SimResult.collect(
        policy,
        sim,
        driver.counters(),
        model=model,
        node=node,
        tp=tp,
        replicas=replicas,
        cost_model=runner.cost.describe(),
        note=note,
        warnings=setup.warnings(),
    )
