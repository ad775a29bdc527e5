"""An emulated link: when a copy of n bytes may finish on a link of a target bandwidth.

On a CPU the "device" and "host" pools are the same RAM, so a reload is hundreds of times
cheaper than recomputing; on an accelerator node it is tens of times cheaper (PCIe against
the GPU's FLOPs). `ThrottledTransport` (`kvpilot.emulate.transport`) wraps any
`TierTransport` and `ThrottledDiskStore` (`kvpilot.emulate.disk`) the disk store: the copies
are real (the bytes move, the blocks stay pinned meanwhile) and so are the waits, but a copy
is done only when its bytes would have crossed a link of the target bandwidth:

    direction free at f, copy of n bytes asked at t  ->  done at max(t, f) + n / bandwidth,
                                                         or when the real copy ends, if later

Each direction is its own queue (links are full duplex). A copy's result is the seconds it
took by that measure, so the engine's bandwidth meters see the emulated link.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvpilot.errors import ConfigError

if TYPE_CHECKING:
    from kvpilot.engine.executor import Transfer

Clock = Callable[[], float]


class LinkSchedule:
    """Per-direction queues of a link of ``bytes_per_s``: when each copy may finish."""

    def __init__(
        self,
        bytes_per_s: float,
        clock: Clock = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        *,
        real_time_counts: bool = True,
    ) -> None:
        if not bytes_per_s > 0:
            raise ConfigError(f"an emulated link needs a positive bandwidth, got {bytes_per_s}")
        self.bytes_per_s = float(bytes_per_s)
        self.clock = clock
        self.sleep = sleep  # how a caller waits for a copy on this clock
        # Whether a real copy slower than its slot makes the emulated copy slower: on a clock
        # of the stepping thread's CPU time (`kvpilot.emulate.clock.ComputeClock`) a copy on
        # another thread is free, as a DMA engine's is, and its end would only read the
        # stepping thread's compute meanwhile (the copy is still done only once it is done).
        self.real_time_counts = real_time_counts
        self._free_at: dict[str, float] = {}
        self._lock = threading.Lock()
        self.bytes_moved: dict[str, int] = {}
        self.busy_s: dict[str, float] = {}

    def reserve(self, direction: str, nbytes: int) -> tuple[float, float]:
        """(start, finish) on the link for ``nbytes`` in ``direction``, queued behind others."""
        with self._lock:
            now = self.clock()
            start = max(now, self._free_at.get(direction, 0.0))
            finish = start + nbytes / self.bytes_per_s
            self._free_at[direction] = finish
            self.bytes_moved[direction] = self.bytes_moved.get(direction, 0) + nbytes
            self.busy_s[direction] = self.busy_s.get(direction, 0.0) + finish - start
            return start, finish


class ThrottledTransfer:
    """A real transfer that is done no earlier than its slot on the emulated link ends.

    ``timed``: the inner result is the seconds the copy took, replaced by the emulated
    duration (slot start to the later of the slot's end and the real copy's); otherwise the
    inner result (bytes read, flags) passes through. ``on_settle`` hears the duration once.
    ``real_time_counts`` False: the slot alone is the copy's duration. ``finish_s``: the
    slot's end, which lets an engine on a clock that skips idle time
    (`kvpilot.emulate.clock.ComputeClock`) skip to it (`kvpilot.engine.idle_skip`); the copy
    is still done only once the real one is too. ``sleep`` waits on ``clock``.
    """

    __slots__ = (
        "_clock",
        "_finish",
        "_inner",
        "_on_settle",
        "_real_end",
        "_settled",
        "_sleep",
        "_start",
        "_timed",
    )

    def __init__(
        self,
        inner: Transfer,
        start: float,
        finish: float,
        clock: Clock,
        *,
        timed: bool,
        on_settle: Callable[[float], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        real_time_counts: bool = True,
    ) -> None:
        self._inner = inner
        self._start = start
        self._finish = finish
        self._clock = clock
        self._timed = timed
        self._on_settle = on_settle
        self._sleep = sleep
        self._settled: float | None = None
        self._real_end: float | None = None
        add_done_callback = getattr(inner, "add_done_callback", None)
        if not real_time_counts:
            self._real_end = finish
        elif add_done_callback is not None:  # when the real copy ended, not when it was polled
            add_done_callback(lambda _f: setattr(self, "_real_end", clock()))

    def _settle(self) -> float:
        if self._settled is None:
            real_end = self._clock() if self._real_end is None else self._real_end
            self._settled = max(self._finish, real_end) - self._start
            if self._on_settle is not None:
                self._on_settle(self._settled)
        return self._settled

    @property
    def finish_s(self) -> float:
        return self._finish

    def done(self) -> bool:
        if self._clock() < self._finish or not self._inner.done():
            return False
        self._settle()
        return True

    def result(self, timeout: float | None = None) -> Any:
        out = self._inner.result(timeout)
        delay = self._finish - self._clock()
        if delay > 0:
            self._sleep(delay)
        seconds = self._settle()
        return seconds if self._timed else out
