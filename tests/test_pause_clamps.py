"""The pause path's clamps are written as conditionals instead of min()/max() calls (every
pause, resume and step reads them): each equals the builtins' formula it replaced, value and
type, for any float (NaN, infinities, signed zeros included); the prefill meter checks and
divides once for its two meters, the same as observing each."""

from __future__ import annotations

import bisect
import math

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpilot.engine.pause_book import PauseBook
from kvpilot.engine.pause_pricing import host_room, pressure_on, working_bytes
from kvpilot.policy.meters import PrefillRateMeter, RateMeter, WaitPredictor
from kvpilot.policy.pause_inputs import MAX_WAIT_S, clamp_wait_s

ANY = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 1e300]),
    st.integers(-3, 3),
)


def same(a: object, b: object) -> bool:
    """Equal to the bit: the same type and repr (tells 0.0 from -0.0, 1 from 1.0, NaN)."""
    return type(a) is type(b) and repr(a) == repr(b)


@settings(max_examples=300, deadline=None)
@given(pressure=ANY)
@example(pressure=-0.0)
@example(pressure=float("nan"))
def test_pressure_on_clamps_as_min_max(pressure: float) -> None:
    # No retained state: the pressure is the engine's, clamped to [0, 1].
    assert same(pressure_on(pressure, PauseBook(), 5.0, 4096.0, 1.0), min(1.0, max(0.0, pressure)))


@settings(max_examples=300, deadline=None)
@given(free=ANY, capacity=ANY)
@example(free=-0.0, capacity=1.0)
def test_host_room_clamps_as_min_max(free: float, capacity: float) -> None:
    book = PauseBook()  # nothing awaited on host: 0.0 bytes
    kept = max(0.0, free - 0.0)
    expected = (kept, min(1.0, max(0.0, 1.0 - kept / max(capacity, 1.0))))
    got = host_room(free, capacity, book)
    assert same(got[0], expected[0]) and same(got[1], expected[1])


@settings(max_examples=300, deadline=None)
@given(used=ANY, evictable=ANY)
@example(used=-0.0, evictable=0.0)  # -0.0: max() keeps its first argument, 0.0
def test_working_bytes_clamps_as_max(used: float, evictable: float) -> None:
    assert same(working_bytes(used, evictable, PauseBook()), max(0.0, used - evictable - 0.0))


@settings(max_examples=300, deadline=None)
@given(wait=st.one_of(ANY, st.sampled_from([MAX_WAIT_S, math.nextafter(MAX_WAIT_S, math.inf)])))
def test_waits_clamp_as_min(wait: float) -> None:
    expected = 0.0 if not wait >= 0.0 else min(float(wait), MAX_WAIT_S)
    assert same(clamp_wait_s(wait), expected)
    predictor = WaitPredictor()
    predictor.observe("tool", wait)
    if wait >= 0:
        assert same(predictor.by_tool["tool"][-1], min(wait, MAX_WAIT_S))
    else:
        assert not predictor.all


step = st.tuples(
    st.integers(-2, 5000),  # prefill tokens
    st.sampled_from([0.0, -1.0, 1e-3, 0.02, 0.5]),  # seconds
    st.integers(0, 100_000),  # context tokens
)


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(step, max_size=30))
def test_prefill_meter_equals_observing_each_meter(steps: list[tuple[int, float, int]]) -> None:
    meter = PrefillRateMeter()
    buckets = [RateMeter() for _ in meter.buckets]
    overall = RateMeter()
    for tokens, seconds, context in steps:
        meter.observe(tokens, seconds, context)
        buckets[bisect.bisect_left(meter.BOUNDS, context)].observe(tokens, seconds)
        overall.observe(tokens, seconds)
    for got, want in zip([*meter.buckets, meter.overall], [*buckets, overall], strict=True):
        assert (got.value, got.samples) == (want.value, want.samples)
    for context in (0, 1024, 1025, 70_000):
        assert meter.tokens_per_s(context, 7.0) == (
            buckets[bisect.bisect_left(meter.BOUNDS, context)].get(overall.get(7.0))
        )
