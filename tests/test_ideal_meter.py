"""`IdealHitMeter`: the ideal (unbounded-cache) hit of a live server, one request at a time."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.trace.ideal import IdealHitMeter, ideal_hits

BS = 4
calls = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(calls)
def test_one_call_at_a_time_gives_the_batch_ideal(sequence: list[list[int]]) -> None:
    meter = IdealHitMeter(BS)
    streamed = []
    for tokens in sequence:
        streamed.append(meter.hit(tokens))
        meter.add(tokens)
    assert streamed == ideal_hits(sequence, BS)


def test_a_hit_leaves_the_last_token_to_compute() -> None:
    meter = IdealHitMeter(BS)
    meter.add(list(range(8)))
    assert meter.hit(list(range(8))) == 4  # 8 tokens seen, but the 8th must be computed
    assert meter.hit(list(range(9))) == 8


def test_tenants_never_share() -> None:
    meter = IdealHitMeter(BS)
    meter.add(list(range(16)), salt="alice")
    assert meter.hit(list(range(17)), salt="alice") == 16
    assert meter.hit(list(range(17)), salt="bob") == 0
    assert meter.hit(list(range(17))) == 0


def test_past_its_bound_it_forgets_the_least_recently_seen_blocks() -> None:
    meter = IdealHitMeter(BS, max_blocks=4)
    old, new = list(range(100, 108)), list(range(200, 208))  # two blocks each
    meter.add(old)
    meter.add(new)
    meter.add(old)  # seen again: now the newest
    meter.add(list(range(300, 308)))  # two more blocks push out the least recent: `new`
    assert len(meter) == 4
    assert meter.hit([*old, 0]) == 8 and meter.hit([*new, 0]) == 0
