"""`ComputeClock`: the engine's time as one thread's CPU time, plus the waits, skipped.

On a machine shared with other work, wall time stretches with the load: a benchmark timed on
it measures the neighbours. The compute clock runs on the CPU time of the thread that steps
the engine (the model runs on it: one intra-op thread), read through that thread's CPU clock
so that any thread (a copier's completion callback) reads the same time. Waiting does not use
CPU, so nothing waits for real: ``sleep`` and ``advance_to`` move the clock on at once (a
tool's pause, an emulated link's copy). What the clock measures is then what the engine
computes (its steps, its bookkeeping) and what it waits for, each at its own length, without
the idle seconds in between; work on other threads (real copies, disk writes) is free unless
the stepping thread waits for it (an emulated link says how long a copy takes:
`kvpilot.emulate.link`).
"""

from __future__ import annotations

import threading
import time

from kvpilot.engine.clock import WallClock
from kvpilot.errors import ConfigError


class ComputeClock:
    """Implements `kvpilot.engine.clock.Clock` on a thread's CPU time plus skipped waits."""

    def __init__(self, thread_id: int | None = None) -> None:
        try:
            ident = threading.get_ident() if thread_id is None else thread_id
            self._cpu_clock = time.pthread_getcpuclockid(ident)
        except (AttributeError, OSError) as exc:  # not a POSIX system with thread CPU clocks
            raise ConfigError(f"a compute clock needs per-thread CPU clocks: {exc}") from exc
        self._origin = time.clock_gettime(self._cpu_clock)
        self._skipped = 0.0
        self._lock = threading.Lock()

    def cpu_s(self) -> float:
        """The stepping thread's CPU seconds since the clock was made."""
        return time.clock_gettime(self._cpu_clock) - self._origin

    def now(self) -> float:
        return self.cpu_s() + self._skipped

    def __call__(self) -> float:  # an `kvpilot.emulate.link.Clock` too
        return self.now()

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass without waiting for them."""
        if seconds > 0:
            with self._lock:
                self._skipped += seconds

    def advance_to(self, t: float) -> None:
        """Move the clock on to ``t`` (never back)."""
        with self._lock:
            self._skipped += max(0.0, t - self.now())

    @property
    def skipped_s(self) -> float:
        """The seconds the clock moved on without computing: waits."""
        return self._skipped


class WallTime(WallClock):
    """The wall clock with the compute clock's interface: ``advance_to`` waits for real."""

    def __call__(self) -> float:
        return self.now()

    def advance_to(self, t: float) -> None:
        self.sleep(t - self.now())

    def cpu_s(self) -> float:
        return time.process_time()

    @property
    def skipped_s(self) -> float:
        return 0.0


BenchClock = ComputeClock | WallTime


def bench_clock(name: str) -> BenchClock:
    """``compute`` (`ComputeClock` on the calling thread) or ``wall`` (`WallTime`)."""
    if name == "compute":
        return ComputeClock()
    if name == "wall":
        return WallTime()
    raise ConfigError(f"unknown clock {name!r}: choose compute or wall")
