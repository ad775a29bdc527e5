"""Pause timers: the next one due ignores cancelled timers, due timers fire earliest first,
and a session's timers are cancelled together (against a model: a list of live timers)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.pause_timers import PauseTimers

SESSIONS = ["a", "b", "c"]

op = st.one_of(
    st.tuples(st.just("at"), st.sampled_from(SESSIONS), st.integers(0, 50)),
    st.tuples(st.just("cancel"), st.sampled_from(SESSIONS), st.just(0)),
    st.tuples(st.just("fire"), st.just(""), st.integers(0, 50)),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op, max_size=40))
def test_timers_match_a_list_of_live_timers(ops: list[tuple[str, str, int]]) -> None:
    timers = PauseTimers()
    live: list[tuple[float, int, str]] = []  # (when, order set, session)
    fired: list[int] = []
    for i, (kind, sid, t) in enumerate(ops):
        if kind == "at":
            timers.at(float(t), sid, lambda i=i: fired.append(i))
            live.append((float(t), i, sid))
        elif kind == "cancel":
            timers.cancel(sid)
            live = [x for x in live if x[2] != sid]
        else:
            fired.clear()
            timers.fire_due(float(t))
            due = sorted(x for x in live if x[0] <= t)
            assert fired == [x[1] for x in due]
            live = [x for x in live if x[0] > t]
        assert timers.next_at() == (min(x[0] for x in live) if live else None)
        assert timers.sessions() == {x[2] for x in live}
        timers.check_invariants()


def test_a_cancelled_earliest_timer_is_not_next() -> None:
    timers = PauseTimers()
    timers.at(1.0, "a", lambda: None)
    timers.at(5.0, "b", lambda: None)
    timers.cancel("a")
    assert timers.next_at() == 5.0
    timers.cancel("b")
    assert timers.next_at() is None
