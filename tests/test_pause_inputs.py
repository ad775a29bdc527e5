"""What the engine tells the pause rule: host pressure, pressure by return order, overdue waits."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.engine.reclaim import reclaim
from kvpilot.memory import Tier
from kvpilot.policy.breakeven import PauseAction

from equivalence import FIRST, PARAMS, SECOND, THIRD, settle, tiered


def test_host_pressure_counts_offloaded_state_not_cache(tmp_path: Path) -> None:
    engine = tiered("tiny", tmp_path, "offload-host")
    host = engine.kv.pools[Tier.HOST]
    capacity = host.num_blocks * engine.offload.block_bytes
    a = engine.open_session()
    a.generate(FIRST, PARAMS)
    a.pause(expected_wait_s=30.0)
    settle(engine)
    assert a.last_pause is not None and host.num_used > 0
    held = a.last_pause.inputs.kv_bytes
    b = engine.open_session()
    b.generate(SECOND, PARAMS)
    b.pause(expected_wait_s=30.0)
    assert b.last_pause is not None
    inputs = b.last_pause.inputs
    assert inputs.host_pressure == pytest.approx(held / capacity)
    assert inputs.host_free_bytes == pytest.approx(capacity - held)
    settle(engine)
    # a comes back: its host copy stays as cache, which is room, not pressure
    a.generate(THIRD, PARAMS)
    a.close()
    c = engine.open_session()
    c.generate([7] * 50, PARAMS)  # shares nothing with b
    c.pause(expected_wait_s=30.0)
    assert c.last_pause is not None
    b_held = b.last_pause.inputs.kv_bytes
    assert host.usage > b_held / capacity  # the cache is there...
    assert c.last_pause.inputs.host_pressure == pytest.approx(b_held / capacity)  # ...and free
    engine.close()


def test_state_back_sooner_than_retained_state_feels_less_pressure(tmp_path: Path) -> None:
    engine = tiered("tiny", tmp_path, "retain")
    engine.offload.pressure = lambda: 1.0
    sessions = [engine.open_session() for _ in range(3)]
    for s, prompt in zip(sessions, (FIRST, SECOND, THIRD), strict=True):
        s.generate(prompt, PARAMS)
    far, near, farther = sessions
    far.pause(expected_wait_s=100.0)
    near.pause(expected_wait_s=1.0)
    farther.pause(expected_wait_s=1000.0)
    assert far.last_pause and near.last_pause and farther.last_pause
    assert far.last_pause.inputs.device_pressure == 1.0  # nothing retained yet
    m_far, m_near = far.last_pause.inputs.kv_bytes, near.last_pause.inputs.kv_bytes
    assert near.last_pause.inputs.device_pressure == pytest.approx(m_near / (m_near + m_far))
    assert farther.last_pause.inputs.device_pressure == 1.0  # back last: feels it all
    engine.close()


def test_reclaim_takes_an_overdue_wait_as_a_long_one(tmp_path: Path) -> None:
    engine = tiered("tiny", tmp_path, "retain")
    quick, slow = engine.open_session(), engine.open_session()
    quick.generate(FIRST, PARAMS)
    slow.generate(SECOND, PARAMS)
    quick.pause(expected_wait_s=1.0)
    slow.pause(expected_wait_s=10.0)
    engine.clock.advance(8.0)  # quick is 7 s overdue: expect 8 s more, past slow's return
    assert reclaim(engine.offload, [quick, slow]) == 1
    record = quick.last_pause
    assert record is not None and record.state == "offloaded"  # demoted to host, awaited
    assert record.action is PauseAction.OFFLOAD_HOST
    assert record.expected_return == pytest.approx(16.0)  # 8 s overdue: as long again
    assert record.prefetch_at is not None and 15.9 < record.prefetch_at < 16.0
    assert slow.last_pause is not None and slow.last_pause.state == "retained"
    assert slow.last_pause.action is PauseAction.RETAIN
    engine.close()


def test_state_demoted_to_host_is_held_there_not_room(tmp_path: Path) -> None:
    engine = tiered("tiny", tmp_path, "retain")
    host = engine.kv.pools[Tier.HOST]
    capacity = host.num_blocks * engine.offload.block_bytes
    a, b = engine.open_session(), engine.open_session()
    a.generate(FIRST, PARAMS)
    a.pause(expected_wait_s=50.0)
    assert reclaim(engine.offload, [a]) == 1
    assert a.last_pause is not None and a.last_pause.state == "offloaded"
    held = a.last_pause.inputs.kv_bytes
    b.generate(SECOND, PARAMS)
    b.pause(expected_wait_s=30.0)
    assert b.last_pause is not None
    assert b.last_pause.inputs.host_free_bytes == pytest.approx(capacity - held)
    assert b.last_pause.inputs.host_pressure == pytest.approx(held / capacity)
    engine.close()
