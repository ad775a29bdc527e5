"""Pause and resume across memory tiers: decide per pause, bring state back before it is used.

When a session pauses on a tool call, the policy chooses for the blocks only it holds (the
deepest exclusive part of its radix path; shared blocks stay where their other holders need
them): retain, offload to host, offload to disk, drop, or leave to the prefix cache. The
`TierMover` carries out moves off the step loop. On resume, or ahead of it by prefetch at
the predicted return, the prefix is made device-resident again; a request whose blocks are
not back yet waits for them, not the whole engine. Under memory pressure, idle sessions
give way by least value per byte held.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpilot.engine.executor import TierTransport
from kvpilot.engine.tier_mover import TierMover
from kvpilot.engine.tier_stats import PauseRecord, TierStats
from kvpilot.errors import InvalidRequest
from kvpilot.memory import KVManager, RadixNode, Tier, Trajectory
from kvpilot.policy.breakeven import PauseAction, PauseDecision, PauseInputs
from kvpilot.policy.meters import PrefillRateMeter, WaitPredictor
from kvpilot.policy.pause import PausePolicy

if TYPE_CHECKING:
    from kvpilot.engine.session import Session
    from kvpilot.store import DiskBlockStore, SessionStore

DEFAULT_PREFILL_TOKENS_PER_S = 2_000.0
IDLE_SAMPLE_S = 1.0  # how often idle memory-time is re-measured (clock seconds)


@dataclass(order=True, slots=True)
class _Timer:
    at: float
    seq: int
    action: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)


class OffloadManager:
    def __init__(
        self,
        kv: KVManager,
        policy: PausePolicy,
        clock: Callable[[], float],
        *,
        transport: TierTransport | None = None,
        disk: DiskBlockStore | None = None,
        session_store: SessionStore | None = None,
        default_wait_s: float = 1.0,
        prefetch: bool = True,
        pressure: Callable[[], float] | None = None,
    ) -> None:
        self.kv = kv
        self.radix = kv.radix
        self.policy = policy
        self.now = clock
        self.session_store = session_store
        self.prefetch_enabled = prefetch
        self.pressure = pressure or (lambda: self.kv.device.usage)
        self.stats = TierStats()
        self.mover = TierMover(kv, self.stats, clock, transport, disk)
        self.prefill = PrefillRateMeter()
        self.waits = WaitPredictor(default_wait_s)
        self.records: dict[str, PauseRecord] = {}
        self.high_water: dict[int, int] = {}  # traj_id -> most tokens ever computed
        self._timers: list[_Timer] = []
        self._timer_ids = itertools.count()
        self._session_timers: dict[str, list[_Timer]] = {}
        self._last_poll = clock()
        self._held_sample = (clock(), 0)

    # -- figures --------------------------------------------------------------------------

    @property
    def host_pool(self) -> Any:
        return self.mover.host_pool

    @property
    def disk(self) -> DiskBlockStore | None:
        return self.mover.disk

    @property
    def block_bytes(self) -> int:
        return self.mover.block_bytes or 1

    def observe_step(self, prefill_tokens: int, seconds: float, context_tokens: int) -> None:
        if prefill_tokens > 0:
            self.prefill.observe(prefill_tokens, seconds, context_tokens)

    def exclusive_nodes(self, traj: Trajectory) -> list[RadixNode]:
        """The deepest part of the trajectory's path that no one else locks, deepest first."""
        nodes: list[RadixNode] = []
        node: RadixNode | None = traj.locked_node
        while node is not None and not node.is_root and node.lock_count == 1:
            nodes.append(node)
            node = node.parent
        return nodes

    def held_bytes(self, traj: Trajectory) -> int:
        blocks = sum(n.num_blocks for n in self.exclusive_nodes(traj) if Tier.DEVICE in n.blocks)
        return (blocks + traj.num_private_blocks) * self.block_bytes

    # -- pausing --------------------------------------------------------------------------

    def pause(
        self, session: Session, expected_wait_s: float | None = None, tool: str | None = None
    ) -> PauseDecision:
        if session.closed:
            raise InvalidRequest(f"session {session.session_id} is closed")
        if session.active_request is not None:
            raise InvalidRequest(
                f"session {session.session_id} is running turn {session.active_request}; "
                "pause it when the turn has finished"
            )
        if expected_wait_s is not None and not (
            math.isfinite(expected_wait_s) and expected_wait_s >= 0
        ):
            raise InvalidRequest("expected_wait_s must be a non-negative number of seconds")
        self._cancel_timers(session.session_id)
        traj = session.traj
        if expected_wait_s is None:
            wait, source = self.waits.predict(tool)
        else:
            wait, source = float(expected_wait_s), "hint from the caller"
        nodes = [n for n in self.exclusive_nodes(traj) if Tier.DEVICE in n.blocks]
        inputs = self._inputs(traj, nodes, wait)
        decision = self._feasible(self.policy.decide(inputs))
        now = self.now()
        lease = self.policy.lease_s(inputs) if decision.action is PauseAction.RETAIN else 0.0
        record = PauseRecord(
            session_id=session.session_id,
            decision=decision,
            inputs=inputs,
            tool=tool,
            wait_source=source,
            paused_at=now,
            expected_return=now + wait,
            lease_until=now + lease,
            state="retained",
        )
        self.records[session.session_id] = record
        self.stats.decisions[str(decision.action)] += 1
        self._apply(session, record, nodes)
        if self.session_store is not None:
            meta = {"action": str(decision.action), "tool": tool, "expected_wait_s": wait}
            self.session_store.save(session.session_id, traj.tokens, session.salt, meta)
        return decision

    def _inputs(self, traj: Trajectory, nodes: list[RadixNode], wait: float) -> PauseInputs:
        mover = self.mover
        tokens = sum(len(n.tokens) for n in nodes) + traj.num_computed_tokens - traj.locked_tokens
        blocks = sum(n.num_blocks for n in nodes) + traj.num_private_blocks
        host = mover.host_pool
        host_free = 0.0
        if host is not None and mover.transport is not None:
            host_free = (host.num_free + self.radix.evictable_blocks(Tier.HOST)) * self.block_bytes
        return PauseInputs(
            kv_bytes=float(blocks * self.block_bytes),
            num_tokens=max(tokens, 0),
            expected_wait_s=wait,
            device_host_bw_bytes_s=mover.link_bw(),
            host_disk_bw_bytes_s=mover.disk_bw(),
            prefill_tokens_per_s=self.prefill.tokens_per_s(
                len(traj.tokens), DEFAULT_PREFILL_TOKENS_PER_S
            ),
            device_pressure=min(1.0, max(0.0, self.pressure())),
            host_pressure=host.usage if host is not None else 1.0,
            host_free_bytes=float(host_free),
        )

    def _feasible(self, decision: PauseDecision) -> PauseDecision:
        """A fixed policy may ask for a tier this engine lacks: fall back, and say so."""
        action = decision.action
        if action is PauseAction.OFFLOAD_HOST and self.mover.link_bw() == 0.0:
            why = "no host tier is configured"
        elif action is PauseAction.OFFLOAD_DISK and self.mover.disk_bw() == 0.0:
            why = "no disk tier is configured"
        else:
            return decision
        reason = (
            f"Drop: the policy chose {action.label.lower()} but {why}, so the state is freed "
            "now and recomputed on return."
        )
        return dataclasses.replace(decision, action=PauseAction.DROP, reason=reason)

    def _apply(self, session: Session, record: PauseRecord, nodes: list[RadixNode]) -> None:
        traj = session.traj
        action = record.action
        if action is PauseAction.RETAIN:
            if math.isfinite(record.lease_until):
                self._at(record.lease_until, session.session_id, lambda: self._expire(session))
            return
        traj.release_kv(keep_in_cache=True)
        if action is PauseAction.CACHE:
            record.state = "cached"
            return
        if action is PauseAction.DROP:
            for node in nodes:
                if node.alive and Tier.DEVICE in node.blocks and node.lock_count == 0:
                    self.radix.drop_copy(node, Tier.DEVICE)
            record.state = "dropped"
            return
        if action is PauseAction.OFFLOAD_HOST:
            self.mover.swap_out(nodes)
            reload_s = record.decision.reload_s
        else:
            self.mover.write_disk(nodes)
            self.mover.disk_hint.add(traj.traj_id)
            reload_s = record.decision.disk_reload_s
        record.state = "offloaded"
        if self.prefetch_enabled:
            record.prefetch_at = record.expected_return - 2 * reload_s - 0.005
            self._at(record.prefetch_at, session.session_id, lambda: self._prefetch(session))

    def _expire(self, session: Session) -> None:
        """A retain lease ran out (ttl): let the prefix cache decide from now on."""
        record = self.records.get(session.session_id)
        if record is None or record.state != "retained" or session.closed:
            return
        if session.active_request is None:
            session.traj.release_kv(keep_in_cache=True)
            record.state = "cached"

    def _prefetch(self, session: Session) -> None:
        record = self.records.get(session.session_id)
        if record is None or session.closed or record.state != "offloaded":
            return
        if session.active_request is not None:
            return
        record.state = "loading"
        if self.mover.ensure_resident(session.traj, prefetch=True, session_id=session.session_id):
            session.traj.reuse_prefix(record=False)
            record.state = "prefetched"

    # -- resume ---------------------------------------------------------------------------

    def ensure_resident(self, traj: Trajectory) -> bool:
        return self.mover.ensure_resident(traj)

    def on_resume(self, session: Session) -> None:
        """A paused session's next turn arrived: learn the wait, score the prefetch."""
        record = self.records.pop(session.session_id, None)
        self._cancel_timers(session.session_id)
        if record is None:
            return
        self.waits.observe(record.tool, self.now() - record.paused_at)
        if record.action in (PauseAction.OFFLOAD_HOST, PauseAction.OFFLOAD_DISK):
            job = self.mover.loads.get(session.traj.traj_id)
            if record.state == "prefetched" and job is None:
                self.stats.prefetch_hits += 1
            elif job is not None and job.prefetch:
                job.prefetch = False
                self.stats.prefetch_stalls += 1

    def record_for(self, session_id: str) -> PauseRecord | None:
        return self.records.get(session_id)

    def take_loaded(self, traj: Trajectory) -> dict[str, int]:
        return self.mover.take_loaded(traj)

    def restored(self, traj: Trajectory) -> None:
        """A session came back from the session store: look for its blocks on disk."""
        self.mover.disk_hint.add(traj.traj_id)

    # -- the step loop's hooks ------------------------------------------------------------

    def busy(self) -> bool:
        return self.mover.busy()

    def poll(self, idle: Callable[[], list[Session]]) -> None:
        """Finish transfers that are done, fire due timers, account idle memory-time."""
        now = self.now()
        if self.mover.transport is not None or self.records:
            when, held = self._held_sample
            if now - when >= IDLE_SAMPLE_S:
                self.stats.idle_gb_s += held * (now - when) / 1e9
                held = sum(self.held_bytes(s.traj) for s in idle())
                self._held_sample = (now, held)
        for job in self.mover.poll():
            if job.traj.closed:
                continue
            # Hold what came back, or a neighbour's load could evict it again.
            job.traj.reuse_prefix(record=False)
            record = self.records.get(job.session_id or "")
            if job.prefetch and record is not None and record.state == "loading":
                record.state = "prefetched"
        while self._timers and self._timers[0].at <= now:
            timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                timer.action()

    def reclaim(self, idle: list[Session]) -> int:
        """Memory pressure: demote the idle trajectory worth least per byte it holds.

        Value is nearness of return: the one expected back last goes first (never-paused
        idle sessions count from when they were last used). Its blocks go to host when
        there is a host tier (waiting for the copy: the blocks are wanted now), else back
        to the prefix cache, where eviction takes them.
        """
        holders = [s for s in idle if s.traj.block_table and self.held_bytes(s.traj)]
        if not holders:
            return 0
        now = self.now()

        def next_use(s: Session) -> float:
            record = self.records.get(s.session_id)
            return record.expected_return if record is not None else now + (now - s.last_used)

        victim = max(holders, key=next_use)
        nodes = [n for n in self.exclusive_nodes(victim.traj) if Tier.DEVICE in n.blocks]
        victim.traj.release_kv(keep_in_cache=True)
        record = self.records.get(victim.session_id)
        if record is not None:
            record.state = "cached"
        has_host = self.mover.transport is not None and self.mover.host_pool is not None
        if has_host and nodes and self.mover.swap_out(nodes) is not None:
            self.mover.wait_moves()
        self.stats.decisions["demoted"] += 1
        return 1

    # -- timers ---------------------------------------------------------------------------

    def _at(self, at: float, session_id: str, action: Callable[[], None]) -> None:
        timer = _Timer(at, next(self._timer_ids), action)
        heapq.heappush(self._timers, timer)
        self._session_timers.setdefault(session_id, []).append(timer)

    def _cancel_timers(self, session_id: str) -> None:
        for timer in self._session_timers.pop(session_id, []):
            timer.cancelled = True

    def next_event_at(self) -> float | None:
        live = [t.at for t in self._timers if not t.cancelled]
        return min(live) if live else None

    def next_poll_at(self) -> float:
        """With no copy in flight, the earliest clock time at which `poll` does anything (a
        timer, an idle memory-time sample): polls before it change nothing (decode runs
        skip them)."""
        timer = self.next_event_at()
        when = math.inf if timer is None else timer
        if self.mover.transport is not None or self.records:
            when = min(when, self._held_sample[0] + IDLE_SAMPLE_S)
        return when

    def forget(self, session: Session) -> None:
        self._cancel_timers(session.session_id)
        self.records.pop(session.session_id, None)
        self.mover.disk_hint.discard(session.traj.traj_id)
        self.high_water.pop(session.traj.traj_id, None)
        if self.session_store is not None:
            self.session_store.delete(session.session_id)

    def close(self) -> None:
        self.mover.close()
        if self.session_store is not None:
            self.session_store.close()
