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

import math
from collections.abc import Callable, Collection
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any, Protocol

from kvpilot.engine import pause_pricing as pricing
from kvpilot.engine.config import PauseConfig
from kvpilot.engine.executor import TierTransport
from kvpilot.engine.idle_held import IdleHeld
from kvpilot.engine.pause_book import PauseBook
from kvpilot.engine.pause_timers import PauseTimers
from kvpilot.engine.tier_mover import TierMover
from kvpilot.engine.tier_stats import PauseRecord, PauseState, TierStats
from kvpilot.errors import InvalidRequest, require
from kvpilot.memory import KVManager, RadixNode, Trajectory
from kvpilot.memory.residency import Residency
from kvpilot.memory.tiers import DEVICE, DISK, HOST
from kvpilot.policy.breakeven import PauseAction, PauseDecision
from kvpilot.policy.meters import DEFAULT_PREFILL_TOKENS_PER_S, PrefillRateMeter, WaitPredictor
from kvpilot.policy.pause import PausePolicy, make_pause_policy
from kvpilot.policy.pause_inputs import PauseInputs, clamp_wait_s

if TYPE_CHECKING:
    from kvpilot.engine.request import Sequence
    from kvpilot.store import DiskBlockStore, SessionStore
    from kvpilot.store.session_store import StoredSession


class PausableSession(Protocol):
    """What the offload manager reads of a session (`kvpilot.engine.session.Session`)."""

    session_id: str
    traj: Trajectory
    salt: str | None
    active_request: str | None
    closed: bool
    last_used: float


# Module constants: an enum member's class attribute lookup is slow, and every pause reads these
# (the tiers' come from `kvpilot.memory.tiers`).
RETAIN, RETAINED = PauseAction.RETAIN, PauseState.RETAINED
HINT = "hint from the caller"  # a pause's wait_source when the caller gave the wait
OFFLOADS = (PauseAction.OFFLOAD_HOST, PauseAction.OFFLOAD_DISK)
IDLE_SAMPLE_S = 1.0  # how often idle memory-time is re-measured (clock seconds)


class OffloadManager:
    # Calls handed straight on, bound in __init__ so that a call has no frame of its own (the
    # step loop, decode runs and admission make them thousands of times a simulated minute):
    # whether a copy is in flight; when the next pause timer (lease end, prefetch) is due, if
    # any; a session is between turns (opened, forked, or its turn ended); make a
    # trajectory's cached prefix device-resident; a session's pause record, if any; and a
    # step's prefill tokens, seconds and context, for the prefill meter (a step without a
    # prefill teaches it nothing).
    busy: Callable[[], bool]  # `TierMover.busy`
    session_idle: Callable[[PausableSession], None]  # `IdleHeld.idle`
    next_event_at: Callable[[], float | None]  # `PauseTimers.next_at`
    ensure_resident: Callable[[Trajectory], Residency]  # `TierMover.ensure_resident`
    record_for: Callable[[str], PauseRecord | None]  # `PauseBook.get`
    observe_step: Callable[[int, float, int], None]  # `PrefillRateMeter.observe`

    def __init__(
        self,
        kv: KVManager,
        config: PauseConfig,
        clock: Callable[[], float],
        *,
        transport: TierTransport | None = None,
        disk: DiskBlockStore | None = None,
        session_store: SessionStore | None = None,
        pressure: Callable[[], float] | None = None,
        policy: PausePolicy | None = None,
    ) -> None:
        self.kv = kv
        self.radix = kv.radix
        self.config = config
        self.policy = policy or make_pause_policy(config.policy, ttl_s=config.ttl_s)
        # A tool's recent waits are copied into a pause's inputs only for a policy that reads
        # them (the rule does not; a policy that does not say is given them).
        self.tool_waits_read = getattr(self.policy, "reads_tool_waits", True)
        self.now = clock
        self.session_store = session_store
        self.prefetch_enabled = config.prefetch
        self.pressure = pressure or (lambda: self.kv.device.usage)
        self.stats = TierStats()
        self.mover = TierMover(kv, self.stats, clock, transport, disk)
        # Fixed when the mover is built, and read by every pause.
        self.block_bytes = self.mover.block_bytes or 1
        self.host = self.mover.host_pool if self.mover.has_host else None  # None: no host tier
        self.prefill = PrefillRateMeter()
        self.waits = WaitPredictor(config.default_tool_wait_s)
        self.records = PauseBook()
        self.timers = PauseTimers()
        # The idle sessions and the device blocks each holds (the session table reports
        # every turn's start and end): what the idle memory-time sample sums.
        self.idle_held = IdleHeld()
        self.busy = self.mover.busy
        self.session_idle = self.idle_held.idle
        self.next_event_at = self.timers.next_at
        self.ensure_resident = self.mover.ensure_resident
        self.record_for = self.records.get
        self.observe_step = self.prefill.observe
        self._held_sample = (clock(), 0)

    # -- figures --------------------------------------------------------------------------

    @property
    def host_pool(self) -> Any:
        return self.mover.host_pool

    @property
    def disk(self) -> DiskBlockStore | None:
        return self.mover.disk

    def exclusive_device_nodes(self, traj: Trajectory) -> list[RadixNode]:
        """The device-resident part of the trajectory's path only it holds, deepest first."""
        nodes = self.kv.residency.exclusive_nodes(traj)
        return [n for n in nodes if DEVICE in n.blocks]

    def held_bytes(self, traj: Trajectory) -> int:
        return pricing.held_blocks(traj) * self.block_bytes

    # -- pausing --------------------------------------------------------------------------

    def pause(
        self,
        session: PausableSession,
        expected_wait_s: float | None = None,
        tool: str | None = None,
    ) -> PauseDecision:
        """Price the blocks only this (open, idle) session holds and apply the policy."""
        if expected_wait_s is None:
            wait, source = self.waits.predict(tool)
            wait = clamp_wait_s(wait)  # timers and figures stay finite whatever was observed
        elif math.isfinite(expected_wait_s) and expected_wait_s >= 0:
            wait, source = clamp_wait_s(expected_wait_s), HINT
        else:
            raise InvalidRequest("expected_wait_s must be a non-negative number of seconds")
        sid = session.session_id
        self.timers.cancel(sid)
        traj = session.traj
        nodes, blocks, tokens = self._exclusive_device(traj)
        now = self.now()
        inputs = self._inputs(traj, blocks, tokens, wait, tool, now)
        decision = self.policy.decide(inputs)
        action = decision.action
        if action in OFFLOADS:  # only an offload can ask for a tier this engine lacks
            decision = pricing.feasible(decision, self.mover.link_bw(), self.mover.disk_bw())
            action = decision.action
        lease = self.policy.lease_s(inputs) if action is RETAIN else 0.0
        # Positional, in field order (session_id, decision, inputs, tool, wait_source,
        # paused_at, expected_return, lease_until, state): a keyword call to a dataclass's
        # __init__ costs ~5k instructions, and every pause makes one.
        record = PauseRecord(
            sid, decision, inputs, tool, source, now, now + wait, now + lease, RETAINED
        )
        self.records.file(record)
        self.stats.decisions[str(action)] += 1
        if action is not RETAIN or math.isfinite(record.lease_until):  # else: nothing to do
            self._apply(session, record, nodes)
        if self.session_store is not None:
            meta = {"action": str(action), "tool": tool, "expected_wait_s": wait}
            self.session_store.save(sid, traj.tokens, session.salt, meta)
        return decision

    def _exclusive_device(self, traj: Trajectory) -> tuple[list[RadixNode], int, int]:
        """`exclusive_device_nodes` of ``traj``, with the blocks and tokens a pause of it
        prices (`pause_inputs`' sums), in one walk up its path."""
        nodes = []
        tokens = traj.num_computed_tokens - traj.locked_tokens
        blocks = traj.num_private_blocks
        node = traj.locked_node
        while node.depth_tokens and node.lock_count == 1:  # depth 0: the root
            device = node.blocks.get(DEVICE)
            if device is not None:
                nodes.append(node)
                tokens += len(node.tokens)
                blocks += len(device)  # every tier's copy has the edge's block count
            node = node.parent  # type: ignore[assignment]  # only the root has none
        return nodes, blocks, tokens

    def pause_inputs(
        self,
        traj: Trajectory,
        nodes: list[RadixNode],
        wait: float,
        tool: str | None = None,
        now: float | None = None,
    ) -> PauseInputs:
        """What the policy is told of a pause of ``traj`` (``nodes``: its exclusive device
        nodes) at ``now`` (the clock's time when not given)."""
        tokens = traj.num_computed_tokens - traj.locked_tokens
        blocks = traj.num_private_blocks
        for node in nodes:  # one pass for both sums
            tokens += len(node.tokens)
            blocks += node.num_blocks
        return self._inputs(traj, blocks, tokens, wait, tool, self.now() if now is None else now)

    def _inputs(
        self, traj: Trajectory, blocks: int, tokens: int, wait: float, tool: str | None, now: float
    ) -> PauseInputs:
        """`pause_inputs` from the sums over the exclusive nodes."""
        mover, bb, records = self.mover, self.block_bytes, self.records
        host_free, host_pressure = pricing.host_room_of(self.host, self.radix, bb, records)
        kv_bytes = float(blocks * bb)
        waits = self.waits.by_tool.get(tool, ()) if tool and self.tool_waits_read else ()
        return PauseInputs(  # positional, in field order (see `pause`'s record)
            kv_bytes,
            tokens if tokens > 0 else 0,  # num_tokens (max(tokens, 0) without the builtin)
            wait,  # expected_wait_s
            mover.device_link_bw(),
            mover.disk_bw(),
            self.prefill.tokens_per_s(len(traj.tokens), DEFAULT_PREFILL_TOKENS_PER_S),
            None,  # num_params
            None,  # prefill_flops_per_s
            pricing.pressure_on(self.pressure(), records, now, kv_bytes, wait),
            host_pressure,
            float(host_free),
            0.0,  # stall_tolerance_s
            pricing.working_bytes(
                self.kv.device.num_used * bb, self.radix.evictable_blocks(DEVICE) * bb, records
            ),
            tool,
            tuple(waits),  # tool_waits
        )

    def _apply(self, session: PausableSession, record: PauseRecord, nodes: list[RadixNode]) -> None:
        traj = session.traj
        action = record.action
        if action is RETAIN:
            if math.isfinite(record.lease_until):
                expire = lambda: self._expire(session)  # noqa: E731
                self.timers.at(record.lease_until, session.session_id, expire)
            return
        traj.release_kv(keep_in_cache=True)
        if action is PauseAction.CACHE:
            self.records.change(record, PauseState.CACHED)
            return
        if action is PauseAction.DROP:
            self.kv.residency.drop_device_copies(nodes)
            self.records.change(record, PauseState.DROPPED)
            return
        if action is PauseAction.OFFLOAD_HOST:
            self.mover.swap_out(nodes)
            reload_s = record.decision.reload_s
        else:
            self.mover.write_disk(nodes)
            self.mover.hint_disk(traj)
            reload_s = record.decision.disk_reload_s
        self.offloaded(session, record, reload_s)

    def offloaded(self, session: PausableSession, record: PauseRecord, reload_s: float) -> None:
        """Off the device and awaited: prefetched back ahead of its return (if that is ahead)."""
        self.records.change(record, PauseState.OFFLOADED)
        at = record.expected_return - 2 * reload_s - 0.005
        if self.prefetch_enabled and math.isfinite(reload_s) and at > self.now():
            record.prefetch_at = at
            prefetch = lambda: self._prefetch(session)  # noqa: E731
            self.timers.at(record.prefetch_at, session.session_id, prefetch)

    def _expire(self, session: PausableSession) -> None:
        """A retain lease ran out (ttl): let the prefix cache decide from now on."""
        record = self.records.get(session.session_id)
        if record is None or record.state is not PauseState.RETAINED or session.closed:
            return
        if session.active_request is None:
            session.traj.release_kv(keep_in_cache=True)
            self.records.change(record, PauseState.CACHED)

    def _prefetch(self, session: PausableSession) -> None:
        record = self.records.get(session.session_id)
        if record is None or session.closed or record.state is not PauseState.OFFLOADED:
            return
        if session.active_request is not None:
            return
        self.records.change(record, PauseState.LOADING)
        state = self.mover.ensure_resident(
            session.traj, prefetch=True, session_id=session.session_id
        )
        if state is Residency.READY:
            session.traj.reuse_prefix(record=False)
            self.records.change(record, PauseState.PREFETCHED)

    # -- resume ---------------------------------------------------------------------------

    def on_admit(self, seq: Sequence) -> None:
        """A sequence was admitted: count the tokens it recomputes that were computed before,
        and (on a request's first admission) which tier its cached prefix came from."""
        traj = seq.traj
        high, last = traj.high_water(), len(traj.tokens) - 1
        lost = (last if last < high else high) - traj.num_computed_tokens  # min(), no builtin
        if lost > 0:
            self.stats.recomputed_tokens += lost
        if seq.index == 0 and not seq.output_token_ids and seq.num_preemptions == 0:
            loaded = self.mover.take_loaded(traj)
            seq.request.set_cached_by_tier(loaded[HOST], loaded[DISK])

    def rewound(self, traj: Trajectory, num_tokens: int) -> None:
        """``traj`` was cut back to ``num_tokens``: what follows the cut is new, not recomputed."""
        traj.cap_high_water(num_tokens)

    def observe_resume_ttft(self, seconds: float) -> None:
        self.stats.resume_ttft_s.append(seconds)

    def on_resume(self, session: PausableSession) -> None:
        """A paused session's next turn arrived: learn the wait, score the prefetch."""
        record = self.records.pop(session.session_id)
        self.timers.cancel(session.session_id)
        if record is None:
            return
        self.waits.observe(record.tool, self.now() - record.paused_at)
        if record.decision.action in OFFLOADS:
            job = self.mover.load_of(session.traj)
            if record.state is PauseState.PREFETCHED and job is None:
                self.stats.prefetch_hits += 1
            elif job is not None and job.prefetch:
                job.prefetch = False
                self.stats.prefetch_stalls += 1

    def stored_session(self, session_id: str) -> StoredSession | None:
        """The session saved when it paused before a restart, if there is a session store."""
        return self.session_store.load(session_id) if self.session_store is not None else None

    def restored(self, traj: Trajectory) -> None:
        """A session came back from the session store: look for its blocks on disk."""
        self.mover.hint_disk(traj)

    # -- the step loop's hooks ------------------------------------------------------------

    def wait_for_copies(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` of real time until a copy run by a thread finishes
        (virtual-time copies are the clock's business); False when there was none."""
        threads = [t for t in self.mover.in_flight() if isinstance(t, Future)]
        if threads:
            wait(threads, timeout=timeout_s, return_when=FIRST_COMPLETED)
        return bool(threads)

    def session_busy(self, session: PausableSession) -> None:
        """``session`` started a turn."""
        self.idle_held.busy(session.session_id)

    def poll(self) -> None:
        """Finish transfers that are done, fire due timers, account idle memory-time (the
        sample sums the figures `idle_held` keeps, equal to walking every idle session's
        path)."""
        now = self.now()
        when, held = self._held_sample
        if now - when >= IDLE_SAMPLE_S and (self.mover.transport is not None or self.records):
            self.stats.idle_gb_s += held * (now - when) / 1e9
            held = self.idle_held.blocks() * self.block_bytes
            self._held_sample = (now, held)
        if self.mover.busy():
            self._finish_loads()
        heap = self.timers.heap
        if heap and heap[0].at <= now:  # a timer is due: `fire_due` has work
            self.timers.fire_due(now)

    def _finish_loads(self) -> None:
        """Advance the transfers that are done; hold the prefixes that came back."""
        for job in self.mover.poll():
            if job.traj.closed:
                continue
            # Hold what came back, or a neighbour's load could evict it again.
            job.traj.reuse_prefix(record=False)
            record = self.records.get(job.session_id or "")
            if job.prefetch and record is not None and record.state is PauseState.LOADING:
                self.records.change(record, PauseState.PREFETCHED)

    def next_poll_at(self) -> float:
        """With no copy in flight, the earliest clock time at which `poll` does anything (a
        timer, an idle memory-time sample): polls before it change nothing (decode runs
        skip them)."""
        timer = self.timers.next_at()
        when = math.inf if timer is None else timer
        if self.mover.transport is not None or self.records:
            sample = self._held_sample[0] + IDLE_SAMPLE_S
            if sample < when:  # min(when, sample) without the builtin
                when = sample
        return when

    def forget(self, session: PausableSession) -> None:
        self.idle_held.busy(session.session_id)
        self.timers.cancel(session.session_id)
        self.records.pop(session.session_id)
        self.mover.forget(session.traj)
        session.traj.forget_high_water()
        if self.session_store is not None:
            self.session_store.delete(session.session_id)

    def close(self) -> None:
        self.mover.close()
        if self.session_store is not None:
            self.session_store.close()

    def check_invariants(self, open_sessions: Collection[str]) -> None:
        """Every record belongs to an open session, every pending timer to a record, every
        pin and move lock to a move or load in flight."""
        self.timers.check_invariants()
        self.mover.check_invariants()
        self.idle_held.check_invariants()
        stale = set(self.records) - set(open_sessions)
        require(not stale, f"pause records of sessions that are not open: {sorted(stale)[:5]}")
        gone = set(self.idle_held) - set(open_sessions)
        require(not gone, f"idle figures of sessions that are not open: {sorted(gone)[:5]}")
        orphans = self.timers.sessions() - set(self.records)
        require(not orphans, f"timers of sessions without a pause record: {sorted(orphans)[:5]}")
        self.records.check_invariants()
