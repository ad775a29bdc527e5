"""The scheduler's hooks into the rest of the engine: admission that keeps hot idle state,
and admission that keeps a hybrid model's window pool from running out.

When the pause rule retained a paused session's state (it is back soon), a new request
whose admission needs that state's device blocks would make it give way
(`kvpilot.engine.reclaim`), and the session would recompute what it lost on its return.
`HotStateGuard` holds such a request back instead while that is the cheaper way: while the
state it would evict is expected back sooner than recomputing the evicted part would take
(the engine idles at most that long; with other work running it does not idle at all), and
for at most ``SchedulerConfig.max_defer_s`` per request, so that nothing waits for ever.
With two agent sessions whose contexts do not fit together, this runs several calls of one
back to back instead of evicting each one's tail at every switch.

A hybrid model's window pool (`kvpilot.memory.window`) can run out while the main pool looks
idle, and what a sequence needs of it is bounded: at most ``ceil(W/B) + 2`` blocks (its
window and the block it grows into), or all its blocks if it is shorter. `WindowAdmission`
admits a sequence only while the pool holds every running sequence's bound, the
newcomer's, and one prefill chunk ahead of a window; otherwise it waits (rather than being
admitted, then preempted as the windows fill, and recomputed). With nothing running, the
scheduler admits regardless, so that nothing waits for ever.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.offload import OffloadManager, PausableSession
from kvpilot.engine.pause_pricing import next_use
from kvpilot.engine.preemption import SwapPreemption
from kvpilot.engine.scheduler import AdmissionHooks
from kvpilot.engine.tier_stats import PauseState
from kvpilot.memory import KVManager, Trajectory
from kvpilot.memory.window import WindowPool
from kvpilot.policy.meters import DEFAULT_PREFILL_TOKENS_PER_S

if TYPE_CHECKING:
    from kvpilot.engine.request import Sequence
    from kvpilot.engine.session import SessionTable


def blocks_short(kv: KVManager, traj: Trajectory) -> int:
    """Device blocks ``traj``'s whole prompt needs beyond the blocks it holds and what is free
    or evictable now (at most 0 when it fits).

    Its cached prefix does not change the figure, so no radix walk is needed: each cached
    block beyond those it holds is one it need not allocate, but also one fewer block of
    room, since it will lock its path; the two cancel."""
    needed = -(-len(traj.tokens) // kv.block_size)
    return needed - len(traj.block_table) - kv.free_blocks()


class HotStateGuard:
    def __init__(
        self,
        kv: KVManager,
        offload: OffloadManager,
        idle: Callable[[], Seq[PausableSession]],
        clock: Callable[[], float],
        max_defer_s: float,
    ) -> None:
        self.kv = kv
        self.offload = offload
        self.idle = idle
        self.now = clock
        self.max_defer_s = max_defer_s
        self.deferred_since: dict[int, float] = {}  # seq_id -> when it was first held back

    def defer(self, seq: Sequence) -> bool:
        """Hold ``seq`` back this step (see the module docstring)?"""
        if self.max_defer_s <= 0 or not self.offload.records:
            return False  # no paused session, nothing retained to protect
        shortfall = blocks_short(self.kv, seq.traj)
        if shortfall <= 0:
            return False  # it fits without evicting anything (the common case)
        now = self.now()
        since = self.deferred_since.get(seq.seq_id)
        if since is not None and now - since >= self.max_defer_s:
            return False
        if not self._evicts_hot_state(shortfall, now):
            return False
        if since is None:
            self._forget_stale(now)
            self.deferred_since[seq.seq_id] = now
        return True

    def admitted(self, seq: Sequence) -> None:
        self.deferred_since.pop(seq.seq_id, None)

    def _forget_stale(self, now: float) -> None:
        """Requests aborted while held back are never admitted: forget them after a while."""
        if len(self.deferred_since) > 64:
            limit = 10 * self.max_defer_s
            for seq_id, since in list(self.deferred_since.items()):
                if now - since > limit:
                    del self.deferred_since[seq_id]

    def _evicts_hot_state(self, shortfall: int, now: float) -> bool:
        """Would making ``shortfall`` blocks of room demote state the pause rule retained
        (idle state gives way back last first; state no rule retained counts as cold) that is
        back sooner than it would take to recompute what it loses?"""
        offload = self.offload

        def back_at(s: PausableSession) -> float:
            record = offload.records.get(s.session_id)
            if record is None or record.state is not PauseState.RETAINED:
                return math.inf
            return next_use(record, now)

        holders = [s for s in self.idle() if s.traj.block_table]
        bs = self.kv.block_size
        for session in sorted(holders, key=back_at, reverse=True):
            held = offload.held_bytes(session.traj) // offload.block_bytes
            if held <= 0:
                continue
            lost = min(held, shortfall) * bs
            rate = offload.prefill.tokens_per_s(
                len(session.traj.tokens), DEFAULT_PREFILL_TOKENS_PER_S
            )
            if back_at(session) - now < lost / rate:
                return True
            shortfall -= held
            if shortfall <= 0:
                break
        return False


class WindowAdmission:
    """Admission against a window pool's bound (see the module docstring)."""

    def __init__(self, pool: WindowPool, config: SchedulerConfig) -> None:
        self.pool = pool
        bs = pool.block_size
        self.per_seq = -(-pool.window // bs) + 2
        chunk = config.max_num_batched_tokens
        if config.chunked_prefill:
            chunk = min(chunk, config.max_prefill_chunk)
        self.chunk_blocks = -(-chunk // bs) + 1  # a prefill chunk ahead of its window

    def bound(self, seq: Sequence) -> int:
        """Window blocks ``seq`` may hold at once before it finishes."""
        params = seq.request.params
        final = len(seq.traj.tokens) + max(0, params.max_tokens - len(seq.output_token_ids))
        return min(-(-final // self.pool.block_size), self.per_seq)

    def fits(self, seq: Sequence, running: Seq[Sequence]) -> bool:
        """May ``seq`` be admitted next to ``running`` without the pool running out?"""
        pool = self.pool
        growth = 0
        for other in running:
            window = other.traj.window
            held = window.num_held if window is not None else 0
            growth += max(0, self.bound(other) - held)
        wanted = pool.held_blocks() + growth + self.bound(seq) + self.chunk_blocks
        return wanted <= pool.num_blocks


def admission_hooks(
    kv: KVManager,
    offload: OffloadManager,
    sessions: SessionTable,
    clock: Callable[[], float],
    max_defer_s: float,
    scheduler: SchedulerConfig | None = None,
) -> tuple[AdmissionHooks, HotStateGuard]:
    """The scheduler's hooks: idle sessions give way, prefixes come back from other tiers,
    preemption swaps when that is cheaper, admissions wait for hot idle state and, with a
    window pool, for room in it (sized by ``scheduler``'s chunks)."""
    swap = SwapPreemption(offload)
    window_room = None
    if kv.window is not None:
        window_room = WindowAdmission(kv.window, scheduler or SchedulerConfig()).fits
    guard = HotStateGuard(kv, offload, sessions.idle, clock, max_defer_s)

    def on_admit(seq: Sequence) -> None:
        if guard.deferred_since:  # most admissions were never held back
            guard.admitted(seq)
        offload.on_admit(seq)

    hooks = AdmissionHooks(
        reclaim_idle=sessions.reclaim_idle,
        ensure_resident=offload.ensure_resident,
        copies_in_flight=offload.busy,
        on_admit=on_admit,
        preempt_cost=swap.cost_per_block,
        swap_out=swap.swap_out,
        defer_admission=guard.defer,
        window_room=window_room,
    )
    return hooks, guard
