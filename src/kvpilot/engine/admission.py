"""The scheduler's hooks into the rest of the engine, and admission that keeps hot idle state.

When the pause rule retained a paused session's state (it is back soon), a new request
whose admission needs that state's device blocks would make it give way
(`OffloadManager.reclaim`), and the session would recompute what it lost on its return.
`HotStateGuard` holds such a request back instead while that is the cheaper way: while the
state it would evict is expected back sooner than recomputing the evicted part would take
(the engine idles at most that long; with other work running it does not idle at all), and
for at most ``SchedulerConfig.max_defer_s`` per request, so that nothing waits for ever.
With two agent sessions whose contexts do not fit together, this runs several calls of one
back to back instead of evicting each one's tail at every switch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from kvpilot.engine.offload import DEFAULT_PREFILL_TOKENS_PER_S, OffloadManager, PausableSession
from kvpilot.engine.pause_pricing import next_use
from kvpilot.engine.preemption import SwapPreemption
from kvpilot.engine.scheduler import AdmissionHooks
from kvpilot.engine.tier_stats import PauseState
from kvpilot.memory import KVManager, Tier

if TYPE_CHECKING:
    from kvpilot.engine.request import Sequence
    from kvpilot.engine.session import SessionTable


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
            return False  # no paused session, nothing retained to protect (the common case)
        now = self.now()
        since = self.deferred_since.get(seq.seq_id)
        if since is not None and now - since >= self.max_defer_s:
            return False
        shortfall = self._blocks_wanted(seq)
        if shortfall <= 0 or not self._evicts_hot_state(shortfall, now):
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

    def _blocks_wanted(self, seq: Sequence) -> int:
        """Device blocks ``seq``'s whole prompt needs beyond what it can reuse and what is
        free or evictable now (its own cached path, which it will lock, not counted)."""
        traj = seq.traj
        bs = self.kv.block_size
        tokens = traj.token_array()
        held = len(traj.block_table)
        peek = self.kv.radix.peek(tokens[: max(len(tokens) - 1, 0)], traj.salt)
        have = max(held, peek.blocks_by_tier.get(Tier.DEVICE, 0))
        room = self.kv.free_blocks() - (have - held)  # its cached path is not room for it
        return -(-len(tokens) // bs) - have - room

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


def admission_hooks(
    kv: KVManager,
    offload: OffloadManager,
    sessions: SessionTable,
    clock: Callable[[], float],
    max_defer_s: float,
) -> tuple[AdmissionHooks, HotStateGuard]:
    """The scheduler's hooks: idle sessions give way, prefixes come back from other tiers,
    preemption swaps when that is cheaper, admissions wait for hot idle state."""
    swap = SwapPreemption(offload)
    guard = HotStateGuard(kv, offload, sessions.idle, clock, max_defer_s)

    def on_admit(seq: Sequence) -> None:
        guard.admitted(seq)
        offload.on_admit(seq)

    hooks = AdmissionHooks(
        reclaim_idle=sessions.reclaim_idle,
        ensure_resident=offload.ensure_resident,
        on_admit=on_admit,
        preempt_cost=swap.cost_per_block,
        swap_out=swap.swap_out,
        defer_admission=guard.defer,
    )
    return hooks, guard
