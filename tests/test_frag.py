from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.errors import ConfigError
from kvpilot.sizing.allocators import (
    GIB,
    KIB,
    MIB,
    BuddyAllocator,
    KvAllocator,
    PagedAllocator,
    StaticAllocator,
)
from kvpilot.sizing.frag_lab import (
    SPEC_REQUEST_BYTES,
    Workload,
    compare_allocators,
    spec_scenario_a,
    spec_scenario_b,
    spec_scenarios,
)

TOKEN = 160 * KIB


def test_scenario_a_static_reservation_admits_4_at_12_5_percent() -> None:
    alloc = spec_scenario_a()
    snap = alloc.snapshot(SPEC_REQUEST_BYTES)
    assert snap.admitted == 4
    assert alloc.slot_bytes == int(2.5 * GIB)
    assert snap.eta_alloc == pytest.approx(0.125)
    assert snap.eta_effective == pytest.approx(0.125)
    assert snap.allocated_bytes - snap.useful_bytes == int(8.75 * GIB)


def test_static_efficiency_is_mean_length_over_s_max() -> None:
    alloc = StaticAllocator(100 * GIB, TOKEN, 32768)
    for i in range(10):
        assert alloc.admit(i, 2048)
    assert alloc.snapshot(0).eta_alloc == pytest.approx(0.0625)


def test_scenario_b_buddy_holes_refuse_a_1_5_gib_request() -> None:
    alloc = spec_scenario_b()
    alloc.check_invariants()
    snap = alloc.snapshot(SPEC_REQUEST_BYTES)
    assert [h // MIB for h in alloc.holes()] == [512, 256, 1024, 768, 1024]
    assert snap.admitted == 10
    assert snap.free_bytes == int(3.5 * GIB)
    assert snap.useful_bytes / GIB == pytest.approx(4.2, abs=0.01)
    assert snap.eta_alloc == pytest.approx(4.2 / 6.5, abs=0.001)
    assert snap.phi_ext == 1.0
    assert not alloc.fits(SPEC_REQUEST_BYTES)
    assert not alloc.admit(10, 4096, reserve_bytes=SPEC_REQUEST_BYTES)


def test_scenario_b_still_serves_a_request_that_fits_a_hole() -> None:
    alloc = spec_scenario_b()
    assert alloc.phi_ext(1024 * MIB) == pytest.approx(1 - 2048 / 3584)
    assert alloc.admit(10, 4000)


def test_spec_scenarios_report_both_napkin_cases() -> None:
    a, b = spec_scenarios()
    assert (a.allocator, a.snapshot.admitted, a.request_fits) == ("static", 4, False)
    assert (b.allocator, b.snapshot.phi_ext, b.request_fits) == ("buddy", 1.0, False)


def test_buddy_rounds_claims_up_to_a_power_of_two() -> None:
    alloc = BuddyAllocator(1 * GIB, TOKEN)
    assert alloc.reservation_bytes(3000 * TOKEN) == 512 * MIB
    assert alloc.admit(0, 3000)
    assert alloc.snapshot(0).allocated_bytes == 512 * MIB


def test_buddy_merges_freed_buddies_back_into_whole_chunks() -> None:
    alloc = BuddyAllocator(10 * GIB, TOKEN)
    for i, tokens in enumerate([100, 5000, 700, 2000, 30, 9000]):
        assert alloc.admit(i, tokens)
    for i in [3, 0, 5, 1, 4, 2]:
        alloc.release(i)
        alloc.check_invariants()
    assert alloc.holes() == [10 * GIB]
    assert alloc.phi_ext(8 * GIB) == pytest.approx(0.2)


def test_buddy_place_rejects_a_misaligned_offset() -> None:
    with pytest.raises(ConfigError, match="not aligned"):
        BuddyAllocator(10 * GIB, TOKEN).place(0, 100 * MIB, 4000)


def test_static_rejects_a_request_longer_than_s_max() -> None:
    with pytest.raises(ConfigError, match="S_max"):
        StaticAllocator(10 * GIB, TOKEN, 16384).admit(0, 20000)


def test_paged_wastes_less_than_a_block_per_request_and_never_fragments() -> None:
    alloc = PagedAllocator(10 * GIB, TOKEN, block_size=16)
    lengths = [17, 1000, 4095, 33, 2048]
    for i, tokens in enumerate(lengths):
        assert alloc.admit(i, tokens)
    snap = alloc.snapshot(SPEC_REQUEST_BYTES)
    assert snap.allocated_bytes - snap.useful_bytes < len(lengths) * 16 * TOKEN
    assert snap.eta_alloc == pytest.approx(sum(lengths) / (16 * sum(-(-n // 16) for n in lengths)))
    assert snap.phi_ext == 0.0


def test_paged_admits_more_than_buddy_more_than_static_under_churn() -> None:
    static, buddy, paged = compare_allocators(10 * GIB, TOKEN, Workload(rounds=60))
    assert static.admitted == 4
    assert static.admitted < buddy.admitted < paged.admitted
    assert buddy.phi_ext > 0.2
    assert paged.phi_ext == 0.0
    assert paged.eta_effective > 0.9
    assert static.eta_effective < 0.25


def test_fill_once_with_a_length_list_matches_scenario_a() -> None:
    workload = Workload(rounds=0, lengths=(2048,))
    static, _, paged = compare_allocators(10 * GIB, TOKEN, workload)
    assert static.final_admitted == 4
    assert static.eta_alloc == pytest.approx(0.125)
    assert paged.final_admitted == 32


def test_workload_is_reproducible_and_has_the_requested_mean() -> None:
    workload = Workload(mean_tokens=2048, sigma=0.5, max_tokens=1 << 20, seed=7)
    first = list(itertools.islice(workload.requests(), 4000))
    assert first == list(itertools.islice(workload.requests(), 4000))
    mean = sum(tokens for tokens, _ in first) / len(first)
    assert mean == pytest.approx(2048, rel=0.05)
    lifetimes = [life for _, life in first]
    assert min(lifetimes) >= 1
    assert sum(lifetimes) / len(lifetimes) == pytest.approx(10, rel=0.1)


def test_workload_lengths_must_fit_s_max() -> None:
    with pytest.raises(ConfigError, match="every length"):
        Workload(max_tokens=100, lengths=(50, 200))


def make_allocator(kind: str) -> KvAllocator:
    pool = 1 * GIB + 3 * MIB  # not a power of two, not a whole number of blocks
    if kind == "static":
        return StaticAllocator(pool, TOKEN, 1024)
    if kind == "buddy":
        return BuddyAllocator(pool, TOKEN)
    return PagedAllocator(pool, TOKEN, 16)


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["static", "buddy", "paged"]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 1024)), max_size=60),
)
def test_allocators_keep_their_invariants_under_any_admit_release_sequence(
    kind: str, ops: list[tuple[bool, int]]
) -> None:
    alloc = make_allocator(kind)
    next_id = 0
    for is_admit, n in ops:
        if is_admit or not alloc.live:
            alloc.admit(next_id, n)
            next_id += 1
        else:
            alloc.release(alloc.live[n % len(alloc.live)])
        alloc.check_invariants()
        snap = alloc.snapshot(64 * MIB)
        assert 0.0 <= snap.phi_ext <= 1.0
        assert 0.0 <= snap.eta_effective <= snap.eta_alloc or snap.admitted == 0
    for request_id in alloc.live:
        alloc.release(request_id)
    alloc.check_invariants()
    assert alloc.free_bytes == alloc.pool_bytes
    assert sum(alloc.holes()) == alloc.pool_bytes
