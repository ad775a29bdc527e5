"""The pause book's running tallies equal a walk of its records, whatever the order of the
pauses, state changes, demotions and resumes; the pressure read from them equals the rule
stated over every record (`pressure_by_walk`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pause_pricing import record as priced_record

from kvpilot.engine.pause_book import PauseBook
from kvpilot.engine.pause_pricing import demoted_to_host, host_room, next_use, pressure_on
from kvpilot.engine.tier_stats import PauseRecord, PauseState
from kvpilot.policy.breakeven import PauseAction

SESSIONS = [f"s{i}" for i in range(6)]


def record(sid: str, kv_bytes: float, paused_at: float, wait: float) -> PauseRecord:
    """A retained pause (`test_pause_pricing.record`)."""
    return priced_record(sid, kv_bytes, paused_at, wait, PauseState.RETAINED)


def pressure_by_walk(
    pressure: float, records: list[PauseRecord], now: float, kv_bytes: float, wait: float
) -> float:
    """The rule as first written: every retained record, back sooner or later than this one."""
    back = now + wait
    sooner = later = 0.0
    for r in records:
        if r.state is PauseState.RETAINED:
            if next_use(r, now) > back:
                later += r.inputs.kv_bytes
            else:
                sooner += r.inputs.kv_bytes
    if later == 0.0:
        return pressure
    return pressure * (sooner + kv_bytes) / (sooner + later + kv_bytes)


def bytes_by_walk(records: list[PauseRecord], state: PauseState, action: PauseAction) -> float:
    return sum(r.inputs.kv_bytes for r in records if r.state is state and r.action is action)


op = st.one_of(
    st.tuples(
        st.just("pause"),
        st.sampled_from(SESSIONS),
        st.integers(1, 1 << 20).map(lambda blocks: float(blocks * 4096)),
        st.floats(0.0, 30.0),  # time since the last pause
        st.floats(0.0, 60.0),  # expected wait
    ),
    st.tuples(st.just("state"), st.sampled_from(SESSIONS), st.sampled_from(list(PauseState))),
    st.tuples(st.just("demote"), st.sampled_from(SESSIONS)),
    st.tuples(st.just("resume"), st.sampled_from(SESSIONS)),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op, max_size=40), later=st.floats(0.0, 200.0), wait=st.floats(0.0, 120.0))
def test_tallies_equal_a_walk_of_the_records(ops: list[tuple], later: float, wait: float) -> None:
    book = PauseBook()
    now = 0.0
    for kind, sid, *args in ops:
        found = book.get(sid)
        if kind == "pause":
            kv, gap, expected = args
            now += gap
            book.file(record(sid, kv, now, expected))
        elif kind == "state" and found is not None:
            book.change(found, args[0])
        elif kind == "demote" and found is not None:
            book.change(found, PauseState.OFFLOADED, demoted_to_host(found.decision))
        elif kind == "resume":
            assert book.pop(sid) is found
        book.check_invariants()
    records = list(book.values())
    assert [r.session_id for r in records] == list(book)
    for state in PauseState:
        for action in PauseAction:
            assert book.bytes_in(state, action) == bytes_by_walk(records, state, action)
        assert book.bytes_in(state) == sum(r.inputs.kv_bytes for r in records if r.state is state)
    # The attributes every pause reads: the same sums, kept apart.
    assert book.retained_bytes == book.bytes_in(PauseState.RETAINED)
    assert book.prefetched_bytes == book.bytes_in(PauseState.PREFETCHED)
    assert book.host_awaited_bytes == book.bytes_in(PauseState.OFFLOADED, PauseAction.OFFLOAD_HOST)
    at = now + later
    for p in (0.0, 0.7, 1.0):
        # Bit for bit: the same figures, summed exactly, whatever the order.
        assert pressure_on(p, book, at, 8192.0, wait) == pressure_by_walk(
            p, records, at, 8192.0, wait
        )


def test_retained_state_back_sooner_is_what_was_paused_lately_and_is_due() -> None:
    book = PauseBook()
    book.file(record("long", 1.0, 0.0, 100.0))  # due at 100
    book.file(record("overdue", 2.0, 10.0, 5.0))  # due at 15, overdue at 25: 25 + 15 = 40
    book.file(record("due", 4.0, 20.0, 5.0))  # due at 25, overdue: 25 + 5 = 30
    book.file(record("late", 8.0, 22.0, 50.0))  # due at 72
    book.file(record("gone", 16.0, 23.0, 1.0))
    book.change(book["gone"], PauseState.CACHED)  # not retained any more
    assert book.retained_back_by(35.0, now=25.0) == 4.0
    assert book.retained_back_by(40.0, now=25.0) == 6.0
    assert book.retained_back_by(100.0, now=25.0) == 15.0
    # this pause (8 bytes) back at 35 gives way to 4 bytes, and the 11 back later to it
    assert pressure_on(1.0, book, 25.0, 8.0, 10.0) == pytest.approx((4 + 8) / (15 + 8))


def test_host_room_holds_back_only_what_offloads_to_host_await() -> None:
    book = PauseBook()
    book.file(record("a", 300.0, 0.0, 10.0))
    book.file(record("b", 200.0, 1.0, 10.0))
    book.change(book["a"], PauseState.OFFLOADED, demoted_to_host(book["a"].decision))
    assert host_room(1000.0, 2000.0, book) == (700.0, pytest.approx(0.65))
    book.change(book["a"], PauseState.PREFETCHED)  # back on the device: room again
    assert host_room(1000.0, 2000.0, book) == (1000.0, 0.5)


def test_state_written_behind_the_books_back_is_caught() -> None:
    book = PauseBook()
    book.file(record("a", 300.0, 0.0, 10.0))
    book.check_invariants()
    book["a"].state = PauseState.CACHED  # not through `change`: the tallies are stale
    with pytest.raises(AssertionError, match="do not match the records"):
        book.check_invariants()


def test_pauses_are_filed_in_pause_order() -> None:
    book = PauseBook()
    book.file(record("a", 300.0, 5.0, 10.0))
    with pytest.raises(AssertionError, match="pause order"):
        book.file(record("b", 300.0, 4.0, 10.0))
    book.file(record("a", 100.0, 6.0, 10.0))  # a session paused again replaces its record
    assert list(book) == ["a"] and book.bytes_in(PauseState.RETAINED) == 100.0


def test_the_retained_index_follows_every_change_in_pause_order() -> None:
    """The retained-sooner walk reads an index of the retained records (pause time, bytes):
    it follows filing, state changes (out of retained and back in), demotions and resumes,
    and keeps pause order when a record comes back to retained."""
    book = PauseBook()
    book.file(record("a", 1.0, 0.0, 4.0))  # due at 4
    book.file(record("b", 2.0, 1.0, 4.0))  # due at 5
    book.file(record("c", 4.0, 2.0, 4.0))  # due at 6
    assert book.retained_back_by(6.0, now=2.0) == 7.0
    book.change(book["b"], PauseState.CACHED)
    assert book.retained_back_by(6.0, now=2.0) == 5.0
    book.change(book["b"], PauseState.RETAINED)  # back in: between a and c, not last
    book.check_invariants()
    assert book.retained_back_by(6.0, now=2.0) == 7.0
    book.change(book["a"], PauseState.OFFLOADED, demoted_to_host(book["a"].decision))
    assert book.retained_back_by(6.0, now=2.0) == 6.0
    book.pop("c")
    assert book.retained_back_by(6.0, now=2.0) == 2.0
    book.file(record("b", 8.0, 3.0, 1.0))  # paused again: the new record replaces the old
    assert book.retained_back_by(6.0, now=3.0) == 8.0
    book.check_invariants()


def test_a_pause_time_written_behind_the_books_back_is_caught() -> None:
    book = PauseBook()
    book.file(record("a", 300.0, 0.0, 10.0))
    book["a"].paused_at = 1.0  # not through the book: the retained index is stale
    with pytest.raises(AssertionError, match="index of retained records"):
        book.check_invariants()


def test_an_expected_return_written_behind_the_books_back_is_caught() -> None:
    """The retained index holds each record's expected return (fixed while it is retained):
    a change made behind the book's back leaves it stale, and the audit says so."""
    book = PauseBook()
    book.file(record("a", 300.0, 0.0, 10.0))
    book["a"].expected_return = 2.0
    with pytest.raises(AssertionError, match="index of retained records"):
        book.check_invariants()
