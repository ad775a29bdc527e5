"""The engine as readers see it: one frozen snapshot of its counters, gauges and tiers.

`Engine.snapshot()` builds it on the engine's own thread; `/metrics`, `/health`, the
simulator's sampling and its reports all read it instead of reaching into the engine's
parts. Figures are copied, so a snapshot never changes after it is taken.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvpilot.memory import Tier

SESSION_STATES = ("running", "waiting", "paused", "idle")

if TYPE_CHECKING:
    from kvpilot.engine.config import EngineConfig
    from kvpilot.engine.offload import OffloadManager
    from kvpilot.engine.scheduler import Scheduler
    from kvpilot.engine.stats import EngineStats
    from kvpilot.memory import KVManager


@dataclass(frozen=True, slots=True)
class TierUsage:
    """One tier's blocks: the pool (or disk slots), those in use, those the radix caches."""

    num_blocks: int = 0
    used_blocks: int = 0
    cached_blocks: int = 0

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(frozen=True, slots=True)
class WindowPoolUsage:
    """A hybrid model's sliding-window layer group (`kvpilot.memory.window`): its own device
    pool beside the main one, which never moves to host or disk.

    Blocks exclude the null block. ``used_blocks`` are off the free list: ``held_blocks``
    that trajectories need, plus cache entries nobody holds (evictable at once);
    ``cached_blocks`` counts every cache entry (some also held). ``released_blocks``: blocks
    open trajectories dropped because they fell wholly outside the window, which full
    attention would still hold in these layers; ``saved_bytes`` is that in bytes (0 when the
    executor does not say what a block costs).
    """

    window_tokens: int = 0
    num_blocks: int = 0
    used_blocks: int = 0
    held_blocks: int = 0
    cached_blocks: int = 0
    released_blocks: int = 0
    block_bytes: int = 0

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def held_usage(self) -> float:
        """What admission weighs against tau_high (`Scheduler.held_usage`)."""
        return self.held_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self.used_blocks

    @property
    def saved_bytes(self) -> int:
        return self.released_blocks * self.block_bytes


@dataclass(frozen=True, slots=True)
class TierLayout:
    """The tiers and the pause policy as the engine applied them."""

    policy: str = ""
    block_size: int = 0
    block_bytes: int = 0
    host_enabled: bool = False
    disk_enabled: bool = False
    disk_dir: str | None = None
    prefetch: bool = True
    default_tool_wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Counters (since start) and gauges (now) of one engine, at ``time_s`` on its clock."""

    time_s: float = 0.0
    # requests and sessions
    running: int = 0
    waiting: int = 0
    open_sessions: int = 0
    sessions_by_state: Mapping[str, int] = field(default_factory=dict)  # SESSION_STATES
    resident_trajectories: int = 0  # open trajectories holding device KV
    steps: int = 0
    step_time_s: float = 0.0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    requests_finished: int = 0
    preemptions: int = 0
    preemptions_swapped: int = 0  # of preemptions: KV swapped to host (the rest recompute)
    admissions_deferred: int = 0  # requests held back for a paused session's hot state
    forks: int = 0
    fork_copied_blocks: int = 0
    # the memory core
    kv_usage: float = 0.0  # device U_KV: blocks allocated over the pool
    kv_held: float = 0.0  # not counting evictable cache; of a hybrid's fuller pool
    tau_high: float = 0.0  # the admission ceiling on kv_held: new work waits above it
    window: WindowPoolUsage | None = None  # hybrid models' sliding-window pool
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    evicted_blocks: int = 0
    tiers: Mapping[str, TierUsage] = field(default_factory=dict)
    layout: TierLayout = field(default_factory=TierLayout)
    # pauses and tier moves
    pause_decisions: Mapping[str, int] = field(default_factory=dict)
    bytes_moved: Mapping[str, int] = field(default_factory=dict)
    loaded_tokens: Mapping[str, int] = field(default_factory=dict)
    prefetch_hits: int = 0
    prefetch_stalls: int = 0
    recomputed_tokens: int = 0
    idle_gb_s: float = 0.0
    disk_misses: int = 0
    reload_p50_s: float = float("nan")
    link_bw_bytes_s: float = 0.0
    disk_bw_bytes_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens of finished requests served from the cache (equation 2)."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Of every lookup in the radix cache."""
        q = self.prefix_queried_tokens
        return self.prefix_hit_tokens / q if q else 0.0

    @property
    def total_bytes_moved(self) -> int:
        return int(sum(self.bytes_moved.values()))


class LoadGauges(NamedTuple):
    """The few gauges the simulator samples every interval, as a snapshot has them."""

    kv_usage: float
    kv_held: float
    running: int
    waiting: int
    resident_trajectories: int


def load_gauges(kv: KVManager, scheduler: Scheduler) -> LoadGauges:
    """`LoadGauges` now, without the rest of a snapshot's cost (every figure is kept as it
    changes: the resident trajectories by the memory core, `KVManager.resident_trajectories`)."""
    return LoadGauges(  # positional (a keyword call per sample costs twice as much)
        kv.device.usage,
        scheduler.held_usage(),
        len(scheduler.running),
        len(scheduler.waiting),
        kv.resident_trajectories,
    )


def take_snapshot(
    now: float,
    config: EngineConfig,
    kv: KVManager,
    scheduler: Scheduler,
    stats: EngineStats,
    offload: OffloadManager,
    *,
    open_sessions: int,
) -> EngineSnapshot:
    """A snapshot of these engine parts (on the engine's thread)."""
    radix = kv.radix
    tiers: dict[str, TierUsage] = {}
    for tier in (Tier.DEVICE, Tier.HOST):
        pool = kv.pools.get(tier)
        if pool is not None:
            tiers[tier.value] = TierUsage(pool.num_blocks, pool.num_used, radix.cached_blocks(tier))
        else:
            tiers[tier.value] = TierUsage()
    mover = offload.mover
    disk = mover.disk
    stored = len(disk) if disk is not None else 0
    tiers[Tier.DISK.value] = TierUsage(disk.num_slots if disk is not None else 0, stored, stored)
    ts = offload.stats
    gauges = load_gauges(kv, scheduler)
    return EngineSnapshot(
        time_s=now,
        running=gauges.running,
        waiting=gauges.waiting,
        open_sessions=open_sessions,
        sessions_by_state=session_state_counts(scheduler, offload, open_sessions),
        resident_trajectories=gauges.resident_trajectories,
        steps=stats.steps,
        step_time_s=stats.step_time_s,
        prompt_tokens=stats.prompt_tokens,
        cached_prompt_tokens=stats.cached_tokens,
        generated_tokens=stats.generated_tokens,
        prefill_tokens=stats.prefill_tokens,
        decode_tokens=stats.decode_tokens,
        requests_finished=stats.requests_finished,
        preemptions=scheduler.num_preemptions,
        preemptions_swapped=scheduler.num_swapped_preemptions,
        admissions_deferred=scheduler.num_deferred_admissions,
        forks=stats.forks,
        fork_copied_blocks=stats.fork_copied_blocks,
        kv_usage=gauges.kv_usage,
        kv_held=gauges.kv_held,
        tau_high=config.scheduler.tau_high,
        window=window_usage(kv),
        prefix_queried_tokens=radix.stats.queried_tokens,
        prefix_hit_tokens=radix.stats.hit_tokens,
        evicted_blocks=radix.stats.evicted_blocks,
        tiers=tiers,
        layout=TierLayout(
            policy=config.pause.policy,
            block_size=kv.block_size,
            block_bytes=mover.block_bytes,
            host_enabled=mover.has_host,
            disk_enabled=disk is not None,
            disk_dir=config.runner.tiers.disk_dir if disk is not None else None,
            prefetch=config.pause.prefetch,
            default_tool_wait_s=config.pause.default_tool_wait_s,
        ),
        pause_decisions=dict(ts.decisions),
        bytes_moved=dict(ts.bytes_moved),
        loaded_tokens={str(t): n for t, n in ts.loaded_tokens.items()},
        prefetch_hits=ts.prefetch_hits,
        prefetch_stalls=ts.prefetch_stalls,
        recomputed_tokens=ts.recomputed_tokens,
        idle_gb_s=ts.idle_gb_s,
        disk_misses=ts.disk_misses,
        reload_p50_s=ts.reload_p50_s(),
        link_bw_bytes_s=mover.link_bw(),
        disk_bw_bytes_s=mover.disk_bw(),
    )


def window_usage(kv: KVManager) -> WindowPoolUsage | None:
    """The window pool's figures (None: no window group); costs one pass over the open
    trajectories, like ``resident_trajectories``."""
    pool = kv.window
    if pool is None:
        return None
    held = pool.held_blocks()
    released = sum(t.window.lo for t in kv.trajectories.values() if t.window is not None)
    return WindowPoolUsage(
        window_tokens=pool.window,
        num_blocks=pool.num_blocks,
        used_blocks=pool.used_blocks,
        held_blocks=held,
        cached_blocks=len(pool.cache),
        released_blocks=released,
        block_bytes=pool.block_bytes,
    )


def scheduled_sessions(scheduler: Scheduler) -> tuple[set[str], set[str]]:
    """Sessions with a sequence running, and those with one waiting (and none running)."""
    running = {s.request.session_id for s in scheduler.running if s.request.session_id}
    waiting = {s.request.session_id for s in scheduler.waiting if s.request.session_id}
    return running, waiting - running


def session_state_counts(
    scheduler: Scheduler, offload: OffloadManager, open_sessions: int
) -> dict[str, int]:
    """Open sessions per state (`SESSION_STATES`): running (a turn is computed), waiting
    (submitted, waiting for admission or for its KV), paused (off at a tool, with a standing
    pause decision), idle. Costs the queues and the pauses, not every open session."""
    running, waiting = scheduled_sessions(scheduler)
    # A pause record lasts until the session's next turn is submitted or it closes.
    counts = {"running": len(running), "waiting": len(waiting), "paused": len(offload.records)}
    counts["idle"] = max(0, open_sessions - sum(counts.values()))
    return counts
