"""The pause records of open sessions, with running tallies of the bytes in each state.

Every pause prices its state against all the others (`pause_pricing`): how much retained
state is back sooner than it, how much host room paused sessions hold, how much device
state idle sessions keep. Walking every record for each pause costs O(sessions) per pause;
the book keeps those sums up to date as records are filed, change state and leave, so a
pause reads them in O(1) (and the one figure that depends on the pause's own wait walks
only the retained records paused within that wait, from an index of them in pause order
that holds each one's pause time, bytes and expected return beside it: the walk reads no
record at all; a retained record's expected return never changes while it stays retained).

Records are filed in pause order, so ``paused_at`` never decreases from oldest to newest.
Every change of a record's state or decision goes through the book (`change`), which is
what keeps the tallies true; `check_invariants` recomputes them from the records.
A record's ``kv_bytes`` are whole bytes (blocks x block bytes): the running sums stay exact
(below 2**53) and equal a fresh walk bit for bit, whatever the order of the changes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping

from kvpilot.engine.tier_stats import PauseRecord, PauseState
from kvpilot.errors import require
from kvpilot.policy.breakeven import PauseAction, PauseDecision

# Module constants: an enum member's class attribute lookup is slow.
RETAINED, PREFETCHED, OFFLOADED = PauseState.RETAINED, PauseState.PREFETCHED, PauseState.OFFLOADED
OFFLOAD_HOST = PauseAction.OFFLOAD_HOST


class PauseBook(Mapping[str, PauseRecord]):
    """Pause records by session id (a read-only mapping, oldest pause first)."""

    def __init__(self) -> None:
        self._records: dict[str, PauseRecord] = {}
        # The three tallies every pause reads (`pause_pricing`): `bytes_in` of RETAINED, of
        # PREFETCHED, and of OFFLOADED decided OFFLOAD_HOST (state awaited on host).
        self.retained_bytes = 0.0
        self.prefetched_bytes = 0.0
        self.host_awaited_bytes = 0.0
        # The retained records, oldest pause first: (paused_at, kv_bytes, expected_return).
        self._retained: dict[str, tuple[float, float, float]] = {}

    # -- the mapping ----------------------------------------------------------------------

    def __getitem__(self, session_id: str) -> PauseRecord:
        return self._records[session_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    # The dict's own lookups: `Mapping`'s generic ones go through __getitem__ and KeyError,
    # and every turn's start and end asks for its session's record.
    def __contains__(self, session_id: object) -> bool:
        return session_id in self._records

    def get(  # type: ignore[override]  # Mapping.get's overloads say the same
        self, session_id: str, default: PauseRecord | None = None
    ) -> PauseRecord | None:
        return self._records.get(session_id, default)

    # -- changes --------------------------------------------------------------------------

    def file(self, record: PauseRecord) -> None:
        """File a new pause (replacing the session's previous record, if any)."""
        sid, records = record.session_id, self._records
        if sid in records:
            self.pop(sid)
        newest = next(reversed(records.values()), None)
        if newest is not None and record.paused_at < newest.paused_at:
            raise AssertionError(
                f"pause of {sid} at {record.paused_at} filed after one at "
                f"{newest.paused_at}: records must come in pause order"
            )
        records[sid] = record
        kv_bytes = record.inputs.kv_bytes
        self._count(record, kv_bytes)
        if record.state is RETAINED:
            self._retained[sid] = (record.paused_at, kv_bytes, record.expected_return)

    def pop(self, session_id: str) -> PauseRecord | None:
        record = self._records.pop(session_id, None)
        if record is not None:
            self._count(record, -record.inputs.kv_bytes)
            self._retained.pop(session_id, None)
        return record

    def change(
        self, record: PauseRecord, state: PauseState, decision: PauseDecision | None = None
    ) -> None:
        """Move a filed record to ``state`` (and to ``decision``, when one is given)."""
        self._count(record, -record.inputs.kv_bytes)
        was_retained = record.state is RETAINED
        record.state = state
        if decision is not None:
            record.decision = decision
        self._count(record, record.inputs.kv_bytes)
        if was_retained and state is not RETAINED:
            del self._retained[record.session_id]
        elif state is RETAINED and not was_retained:
            # Back to retained (the engine never does this): re-index in pause order.
            self._retained = self._retained_by_walk()

    def _count(self, record: PauseRecord, kv_bytes: float) -> None:
        state = record.state
        if state is RETAINED:
            self.retained_bytes += kv_bytes
        elif state is PREFETCHED:
            self.prefetched_bytes += kv_bytes
        elif state is OFFLOADED and record.decision.action is OFFLOAD_HOST:
            self.host_awaited_bytes += kv_bytes

    # -- the tallies ----------------------------------------------------------------------

    def bytes_in(self, state: PauseState, action: PauseAction | None = None) -> float:
        """Bytes of the records in ``state`` (decided ``action``, when one is given), by a
        walk: pricing reads the three kept tallies above, this is for reports and tests."""
        return sum(
            r.inputs.kv_bytes
            for r in self._records.values()
            if r.state is state and (action is None or r.action is action)
        )

    def retained_back_by(self, back: float, now: float) -> float:
        """Bytes of retained state expected back by ``back`` (`pause_pricing.next_use` at
        ``now`` no later than it). Newest first: ``next_use`` is at least ``now + (now -
        paused_at)``, which only grows with age, so the walk stops at the first record
        paused longer ago than that allows."""
        sooner = 0.0
        for paused_at, kv_bytes, expected_return in reversed(self._retained.values()):
            if now + (now - paused_at) > back:  # every pause walks this loop
                break
            if expected_return <= back:
                sooner += kv_bytes
        return sooner

    def _retained_by_walk(self) -> dict[str, tuple[float, float, float]]:
        return {
            sid: (r.paused_at, r.inputs.kv_bytes, r.expected_return)
            for sid, r in self._records.items()
            if r.state is RETAINED
        }

    def check_invariants(self) -> None:
        """The tallies equal a walk of the records, which are filed in pause order."""
        walked: defaultdict[tuple[PauseAction, PauseState], float] = defaultdict(float)
        walked_states: defaultdict[PauseState, float] = defaultdict(float)
        last = -float("inf")
        for sid, record in self._records.items():
            require(record.session_id == sid, f"record of {record.session_id} filed as {sid}")
            require(isinstance(record.state, PauseState), f"record {sid}: bad state")
            require(record.paused_at >= last, f"record {sid} is out of pause order")
            last = record.paused_at
            walked[record.action, record.state] += record.inputs.kv_bytes
            walked_states[record.state] += record.inputs.kv_bytes
        kept_apart = (self.retained_bytes, self.prefetched_bytes, self.host_awaited_bytes)
        host_awaited = walked[OFFLOAD_HOST, OFFLOADED]
        require(
            kept_apart == (walked_states[RETAINED], walked_states[PREFETCHED], host_awaited),
            f"retained, prefetched, host-awaited bytes {kept_apart} do not match the records",
        )
        require(
            list(self._retained.items()) == list(self._retained_by_walk().items()),
            "the index of retained records does not match the records",
        )
