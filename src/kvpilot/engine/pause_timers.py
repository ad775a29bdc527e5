"""Timers of paused sessions (a retain lease running out, a prefetch before the predicted
return), fired by the step loop on the engine's clock."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(order=True, slots=True)
class _Timer:
    at: float
    seq: int
    session_id: str = field(compare=False)
    action: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)


class PauseTimers:
    """A heap of timers, each owned by a session (cancelled together when it resumes)."""

    def __init__(self) -> None:
        # Earliest first. Read, never changed, by the offload manager's poll: a poll that
        # finds nothing due (the heap's top later than now) makes no call.
        self.heap: list[_Timer] = []
        self._ids = itertools.count()
        self._by_session: dict[str, list[_Timer]] = {}

    def at(self, when: float, session_id: str, action: Callable[[], None]) -> None:
        timer = _Timer(when, next(self._ids), session_id, action)
        heapq.heappush(self.heap, timer)
        self._by_session.setdefault(session_id, []).append(timer)

    def cancel(self, session_id: str) -> None:
        timers = self._by_session.pop(session_id, None)  # every pause and resume: no list
        if timers is not None:
            for timer in timers:
                timer.cancelled = True

    def fire_due(self, now: float) -> None:
        """Run every live timer due by ``now``, earliest first."""
        heap = self.heap
        while heap and heap[0].at <= now:
            timer = heapq.heappop(heap)
            if timer.cancelled:
                continue
            owned = self._by_session.get(timer.session_id)
            if owned is not None:
                owned.remove(timer)
                if not owned:
                    del self._by_session[timer.session_id]
            timer.action()

    def next_at(self) -> float | None:
        heap = self.heap
        while heap and heap[0].cancelled:  # cancelled timers leave the top as they reach it
            heapq.heappop(heap)
        return heap[0].at if heap else None

    def sessions(self) -> set[str]:
        """Sessions with a live (pending, not cancelled) timer."""
        return set(self._by_session)

    def check_invariants(self) -> None:
        pending = {id(t) for t in self.heap if not t.cancelled}
        owned = [t for timers in self._by_session.values() for t in timers]
        assert all(not t.cancelled for t in owned), "a cancelled timer is still owned"
        assert {id(t) for t in owned} == pending, "live timers and their owners disagree"
        for sid, timers in self._by_session.items():
            assert timers and all(t.session_id == sid for t in timers), f"timers of {sid} mixed"
