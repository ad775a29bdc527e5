"""Time as the engine sees it. The engine never reads wall time directly: it asks a Clock.

The real engine runs on `WallClock`; the simulator supplies a `VirtualClock` that it
advances by the cost model's iteration times.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since an arbitrary origin, monotonic."""
        ...

    def sleep(self, seconds: float) -> None:
        """Let `seconds` pass (a virtual clock just advances)."""
        ...


class WallClock:
    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class VirtualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        self._now += seconds

    def advance_to(self, t: float) -> None:
        if t > self._now:  # max(self._now, t) without the builtin's call (a NaN stays put)
            self._now = t

    def move(self, shown: float, t: float) -> None:
        """Jump from ``shown`` to ``t`` (not earlier): a decode run's visit to a later step.
        The clock must still show ``shown``, where the run left it: anything else moving it
        inside a run would shift every later step (`kvpilot.engine.decode_run`)."""
        if self._now != shown:
            raise AssertionError("the clock moved inside a decode run")
        self._now = t
