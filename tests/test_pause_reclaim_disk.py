"""Memory pressure demotes idle state to disk when the host has no room for it (and the disk
round trip beats a recompute): the state is written there, prefetched back at its return,
and every resumed turn equals a recompute."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_pause_pricing import record

from kvpilot.engine.pause_pricing import demoted_to, disk_demotion_reload_s, reload_of
from kvpilot.engine.reclaim import reclaim
from kvpilot.engine.tier_stats import PauseState
from kvpilot.policy.breakeven import PauseAction

from equivalence import (
    FIRST,
    PARAMS,
    SECOND,
    LogitRecorder,
    assert_same_turns,
    reference_turns,
    settle,
    tiered,
)

OTHER = [(17 * i + 5) % 240 + 5 for i in range(150)]  # shares no block with FIRST


def test_disk_demotion_pays_when_its_round_trip_beats_a_recompute() -> None:
    # 1 MB over min(2 GB/s link, 100 MB/s disk): 10 ms each way; recompute 1,000 tokens at
    # 10k tokens/s: 100 ms, or at 60k tokens/s: 16.7 ms (under the 20 ms round trip)
    assert disk_demotion_reload_s(1e6, 1000, 2e9, 1e8, 1e4) == pytest.approx(0.01)
    assert disk_demotion_reload_s(1e6, 1000, 1e8, 2e9, 1e4) == pytest.approx(0.01)
    assert disk_demotion_reload_s(1e6, 1000, 2e9, 1e8, 6e4) is None
    assert disk_demotion_reload_s(1e6, 1000, 2e9, 0.0, 1e4) is None  # no disk tier
    assert disk_demotion_reload_s(0.0, 1000, 2e9, 1e8, 1e4) is None  # nothing to move


def test_a_state_demoted_to_disk_is_recorded_as_offloaded_there() -> None:
    r = record("a", 100.0, 0.0, 10.0, PauseState.RETAINED)
    d = demoted_to(r.decision, 0.25)
    assert d.action is PauseAction.OFFLOAD_DISK and reload_of(d) == 0.25
    assert d.disk_round_trip_s == 0.5
    assert d.reason.startswith("Offload to disk (demoted under memory pressure, no host room")
    assert demoted_to(r.decision, None).action is PauseAction.OFFLOAD_HOST


def test_reclaim_demotes_to_disk_when_the_host_has_no_room_and_prefetches_it_back(
    tmp_path: Path,
) -> None:
    engine = tiered("tiny", tmp_path, "retain", host_kv_blocks=2)
    a = engine.open_session()
    a.generate(FIRST, PARAMS)
    a.pause(expected_wait_s=30.0, tool="pytest")
    used = engine.kv.device.num_used
    assert reclaim(engine.offload, [a]) == 1
    engine.check_invariants()
    stats, record = engine.offload.stats, a.last_pause
    assert stats.demoted_to == {"disk": 1}
    assert stats.bytes_moved["device_to_disk"] >= (len(FIRST) // 16) * engine.offload.block_bytes
    assert stats.bytes_moved["device_to_host"] == 0
    assert engine.kv.device.num_used < used  # the write is done: the device copy is gone
    assert record is not None and record.state == "offloaded"
    assert record.action is PauseAction.OFFLOAD_DISK
    assert record.prefetch_at is not None and record.prefetch_at < record.expected_return
    engine.clock.advance_to(record.prefetch_at + 1e-6)
    engine.step()  # the prefetch timer fires and starts the disk read
    settle(engine)
    assert record.state == "prefetched"
    engine.clock.advance_to(record.expected_return)
    out = a.generate(SECOND, PARAMS)
    assert out.cached_tokens_by_tier["disk"] >= (len(FIRST) // 16) * 16
    assert stats.prefetch_hits == 1 and stats.prefetch_stalls == 0
    engine.close()


def test_a_host_with_room_still_takes_the_demotion(tmp_path: Path) -> None:
    engine = tiered("tiny", tmp_path, "retain")
    a = engine.open_session()
    a.generate(FIRST, PARAMS)
    a.pause(expected_wait_s=30.0)
    assert reclaim(engine.offload, [a]) == 1
    assert engine.offload.stats.demoted_to == {"host": 1}
    assert a.last_pause is not None and a.last_pause.action is PauseAction.OFFLOAD_HOST
    engine.close()


def test_with_no_host_room_and_a_recompute_cheaper_than_disk_reclaim_drops(
    tmp_path: Path,
) -> None:
    engine = tiered("tiny", tmp_path, "retain", host_kv_blocks=2)
    engine.offload.prefill.tokens_per_s = lambda *_: 1e12  # type: ignore[method-assign]
    a = engine.open_session()
    a.generate(FIRST, PARAMS)
    a.pause(expected_wait_s=30.0)
    assert reclaim(engine.offload, [a]) == 1
    assert engine.offload.stats.demoted_to == {"cache": 1}
    assert engine.offload.stats.bytes_moved["device_to_disk"] == 0
    assert a.last_pause is not None and a.last_pause.state == "cached"
    engine.close()


def test_pressure_demotes_to_disk_and_resumed_turns_equal_a_recompute(
    hf_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """A device pool that holds one session's turn, a host tier of two blocks: the second
    session's turn makes reclaim demote the first's retained state, which goes to disk."""
    model = hf_checkpoint("llama")
    engine = tiered(model, tmp_path, "retain", kv_blocks=14, host_kv_blocks=2)
    recorder = LogitRecorder(engine)
    a, b = engine.open_session(), engine.open_session()
    first = recorder.turn(a, FIRST)
    a.pause(expected_wait_s=30.0, tool="pytest")
    settle(engine)
    other = recorder.turn(b, OTHER)
    settle(engine)
    stats = engine.offload.stats
    assert stats.demoted_to["disk"] >= 1 and stats.demoted_to["cache"] == 0
    assert a.last_pause is not None and a.last_pause.action is PauseAction.OFFLOAD_DISK
    second = recorder.turn(a, SECOND)
    engine.check_invariants()
    assert stats.bytes_moved["disk_to_device"] > 0
    assert_same_turns([first, second], reference_turns(model, [FIRST, SECOND]))
    assert_same_turns([other], reference_turns(model, [OTHER]))
    engine.close()
