"""The engine's inputs to the pause rule, hand-worked: the work a recompute stalls, which
idle state memory pressure demotes, and the record of a demotion to host."""

from __future__ import annotations

import dataclasses

import pytest

from kvpilot.engine.pause_book import PauseBook
from kvpilot.engine.pause_pricing import demoted_to_host, pick_demotion, working_bytes
from kvpilot.engine.tier_stats import PauseRecord, PauseState
from kvpilot.policy.breakeven import PauseAction, PauseInputs, decide_pause

INPUTS = PauseInputs(
    kv_bytes=100.0,
    num_tokens=10,
    expected_wait_s=5.0,
    device_host_bw_bytes_s=1e3,
    host_disk_bw_bytes_s=0.0,
    prefill_tokens_per_s=100.0,
)


def record(
    sid: str, kv_bytes: float, paused_at: float, wait: float, state: PauseState
) -> PauseRecord:
    inputs = dataclasses.replace(INPUTS, kv_bytes=kv_bytes, expected_wait_s=wait)
    return PauseRecord(
        session_id=sid,
        decision=decide_pause(inputs),
        inputs=inputs,
        tool=None,
        wait_source="hint",
        paused_at=paused_at,
        expected_return=paused_at + wait,
        lease_until=paused_at,
        state=state,
    )


@dataclasses.dataclass
class Idle:
    session_id: str
    last_used: float


def test_working_bytes_leave_out_the_cache_and_idle_state() -> None:
    records = PauseBook()
    records.file(record("a", 300.0, 0.0, 10.0, PauseState.RETAINED))
    records.file(record("b", 200.0, 0.0, 10.0, PauseState.PREFETCHED))
    records.file(record("c", 900.0, 0.0, 10.0, PauseState.OFFLOADED))  # not on the device
    # 2000 in use, 400 of it evictable cache, 500 held by idle sessions: 1100 working
    assert working_bytes(2000.0, 400.0, records) == 1100.0
    assert working_bytes(500.0, 400.0, records) == 0.0  # never below zero


def test_memory_pressure_demotes_the_state_back_last_overdue_as_long_again() -> None:
    now = 20.0
    records = {
        "soon": record("soon", 100.0, 10.0, 15.0, PauseState.RETAINED),  # back at 25
        "late": record("late", 100.0, 10.0, 30.0, PauseState.RETAINED),  # back at 40
        "over": record("over", 100.0, 0.0, 5.0, PauseState.RETAINED),  # due at 5: 20 + 20 = 40.
    }
    idle = [Idle("soon", 0.0), Idle("late", 0.0), Idle("over", 0.0)]
    assert pick_demotion(idle, records, now).session_id in ("late", "over")
    records["over"] = record("over", 100.0, 1.0, 5.0, PauseState.RETAINED)  # 20 + 19 = 39
    assert pick_demotion(idle, records, now).session_id == "late"
    # A session never paused counts from its last use, as long again: 20 + 18 = 38 < 40.
    assert pick_demotion([*idle, Idle("fresh", 2.0)], records, now).session_id == "late"
    assert pick_demotion([*idle, Idle("fresh", -30.0)], records, now).session_id == "fresh"


def test_a_state_demoted_to_host_is_recorded_as_offloaded_there() -> None:
    r = record("a", 100.0, 0.0, 5.0, PauseState.RETAINED)
    d = demoted_to_host(r.decision)
    assert d.action is PauseAction.OFFLOAD_HOST
    assert d.reload_s == r.decision.reload_s == pytest.approx(0.1)  # 100 B at 1 kB/s
    assert d.reason.startswith("Offload to host (demoted under memory pressure after: ")
