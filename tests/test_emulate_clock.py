"""The compute clock: the stepping thread's CPU time, waits skipped; links that run on it."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from kvpilot.emulate.clock import ComputeClock, WallTime, bench_clock
from kvpilot.emulate.link import LinkSchedule, ThrottledTransfer
from kvpilot.engine.clock import WallClock
from kvpilot.errors import ConfigError


def done_future() -> Future[Any]:
    f: Future[Any] = Future()
    f.set_result(0.0)
    return f


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_sleeping_moves_the_clock_without_waiting() -> None:
    clock = ComputeClock()
    wall, t0 = time.perf_counter(), clock.now()
    clock.sleep(30.0)
    clock.sleep(-1.0)  # nothing: a clock never goes back
    assert clock.now() - t0 == pytest.approx(30.0, abs=0.01)
    clock.advance_to(clock.now() + 5.0)
    clock.advance_to(0.0)  # in the past: nothing
    assert clock.now() - t0 == pytest.approx(35.0, abs=0.01)
    assert clock.skipped_s == pytest.approx(35.0, abs=0.01)
    assert time.perf_counter() - wall < 1.0


def test_only_the_stepping_threads_compute_counts() -> None:
    clock = ComputeClock()
    t0 = clock.now()
    time.sleep(0.05)  # blocked: no CPU
    other = threading.Thread(target=spin, args=(0.1,))
    other.start()
    other.join()  # another thread's CPU
    assert clock.now() - t0 < 0.04
    spin(0.05)
    assert clock.now() - t0 >= 0.05
    # Read from another thread, it is still the stepping thread's time.
    seen: list[float] = []
    reader = threading.Thread(target=lambda: seen.append(clock()))
    reader.start()
    reader.join()
    assert seen[0] == pytest.approx(clock.now(), abs=0.01)


def test_a_copy_on_the_compute_clock_takes_its_slot_and_no_real_time() -> None:
    clock = ComputeClock()
    link = LinkSchedule(1e6, clock, clock.sleep, real_time_counts=False)
    start, finish = link.reserve("out", 20_000)  # 20 ms of link
    inner: Future[Any] = Future()
    heard: list[float] = []
    copy = ThrottledTransfer(
        inner,
        start,
        finish,
        clock,
        timed=True,
        on_settle=heard.append,
        sleep=link.sleep,
        real_time_counts=link.real_time_counts,
    )
    assert copy.finish_s == finish
    spin(0.06)  # the stepping thread computes while the copier works, past the slot
    inner.set_result(0.5)  # the real copy's own wall seconds do not count either
    assert copy.result() == pytest.approx(0.02)
    assert heard == [pytest.approx(0.02)]
    s2, f2 = link.reserve("out", 2_000_000)
    late = ThrottledTransfer(done_future(), s2, f2, clock, timed=True, sleep=link.sleep)
    wall = time.perf_counter()
    assert late.result() == pytest.approx(2.0, abs=0.01)  # waited for on the clock: no sleep
    assert time.perf_counter() - wall < 0.5


def test_a_copy_slower_than_its_slot_counts_on_the_wall_clock() -> None:
    # The default: the real copy's end is read when it ends (see test_emulate.py).
    t = 100.0
    inner: Future[Any] = Future()
    copy = ThrottledTransfer(inner, 100.0, 100.5, lambda: t, timed=True)
    t = 101.0
    inner.set_result(0.0)
    assert copy.result() == pytest.approx(1.0)


def test_bench_clocks() -> None:
    assert isinstance(bench_clock("compute"), ComputeClock)
    wall = bench_clock("wall")
    assert isinstance(wall, WallClock) and isinstance(wall, WallTime)
    t0 = wall()
    wall.advance_to(t0 + 0.02)  # waits for real
    assert wall.now() - t0 >= 0.02 and wall.skipped_s == 0.0
    with pytest.raises(ConfigError, match="compute or wall"):
        bench_clock("cpu")
