"""A state memory pressure demotes again after it was prefetched back keeps its host copy:
reclaim records it as demoted to host with nothing to copy, awaited there (host room counts
it) and prefetched back again, rather than left to the prefix cache where host LRU could
take the copy a paused session still awaits. Resumed turns equal a recompute."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvpilot.engine import Engine
from kvpilot.engine.reclaim import reclaim
from kvpilot.engine.session import Session
from kvpilot.engine.tier_stats import PauseState
from kvpilot.memory import Tier
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


def _prefetched(engine: Engine, session: Session) -> None:
    """Demote ``session``'s retained state to host, then let its prefetch bring it back."""
    assert reclaim(engine.offload, [session]) == 1
    record = session.last_pause
    assert record is not None and record.state == PauseState.OFFLOADED
    assert record.prefetch_at is not None
    engine.clock.advance_to(record.prefetch_at + 1e-6)
    engine.step()
    settle(engine)
    assert record.state == PauseState.PREFETCHED


def test_a_prefetched_state_demoted_again_is_awaited_on_host_without_a_copy(
    tmp_path: Path,
) -> None:
    engine = tiered("tiny", tmp_path, "retain")
    a = engine.open_session()
    a.generate(FIRST, PARAMS)
    a.pause(expected_wait_s=2.0, tool="pytest")
    _prefetched(engine, a)
    offload, record = engine.offload, a.last_pause
    assert record is not None
    nodes = offload.exclusive_device_nodes(a.traj)
    assert nodes and all(Tier.HOST in n.blocks for n in nodes)  # the copy is still there
    copied = offload.stats.bytes_moved["device_to_host"]
    engine.clock.advance(3.0)  # overdue: memory pressure demotes it again
    assert reclaim(offload, [a]) == 1
    engine.check_invariants()
    assert offload.stats.demoted_to == {"host": 2}
    assert offload.stats.bytes_moved["device_to_host"] == copied  # nothing copied again
    assert record.action is PauseAction.OFFLOAD_HOST and record.state == PauseState.OFFLOADED
    assert record.prefetch_at is not None and record.prefetch_at > engine.clock.now()
    # Host room counts it as held (awaited), so LRU room for others excludes it.
    assert offload.records.bytes_in(PauseState.OFFLOADED, PauseAction.OFFLOAD_HOST) == (
        record.inputs.kv_bytes
    )
    engine.clock.advance_to(record.prefetch_at + 1e-6)
    engine.step()
    settle(engine)
    assert record.state == PauseState.PREFETCHED
    engine.close()


@pytest.mark.parametrize("policy", ["retain", "breakeven"])
def test_resumed_turns_after_a_second_demotion_equal_a_recompute(
    hf_checkpoint: Callable[[str], Path], tmp_path: Path, policy: str
) -> None:
    model = hf_checkpoint("llama")
    engine = tiered(model, tmp_path, policy)
    recorder = LogitRecorder(engine)
    a = engine.open_session()
    first = recorder.turn(a, FIRST)
    a.pause(expected_wait_s=2.0, tool="pytest")
    _prefetched(engine, a)
    engine.clock.advance(3.0)
    assert reclaim(engine.offload, [a]) == 1
    assert engine.offload.stats.demoted_to == {"host": 2}
    second = recorder.turn(a, SECOND)
    engine.check_invariants()
    assert_same_turns([first, second], reference_turns(model, [FIRST, SECOND]))
    engine.close()


def test_reclaim_lets_copies_out_under_way_free_their_blocks_before_demoting(
    tmp_path: Path,
) -> None:
    """A pause's offload to host is still copying when memory is needed: reclaim waits for
    it (its blocks are on their way out) rather than demote another idle state as well."""
    engine = tiered("tiny", tmp_path, "offload-host")
    a, b = engine.open_session(), engine.open_session()
    b.generate(SECOND, PARAMS)  # idle, holding its blocks, never paused
    a.generate(FIRST, PARAMS)
    a.pause(expected_wait_s=30.0)
    offload = engine.offload
    assert offload.mover.moves  # the offload is in flight
    used = engine.kv.device.num_used
    held_b = offload.held_bytes(b.traj)
    assert reclaim(offload, [b]) == 1
    assert not offload.mover.moves
    assert engine.kv.device.num_used < used  # a's blocks came free
    assert offload.held_bytes(b.traj) == held_b  # b keeps its state
    assert offload.stats.decisions["demoted"] == 0 and not offload.stats.demoted_to
    assert reclaim(offload, [b]) == 1  # nothing under way now: b gives way
    assert offload.stats.demoted_to == {"host": 1}
    engine.check_invariants()
    engine.close()


def test_a_write_to_disk_under_way_does_not_hold_reclaim_back(tmp_path: Path) -> None:
    """A write to disk runs at the disk's speed: reclaim demotes an idle state to host
    rather than wait for it alone."""
    engine = tiered("tiny", tmp_path, "offload-disk")
    a, b = engine.open_session(), engine.open_session()
    b.generate(SECOND, PARAMS)
    a.generate(FIRST, PARAMS)
    a.pause(expected_wait_s=30.0)
    offload = engine.offload
    assert offload.mover.moves  # the write is under way
    assert reclaim(offload, [b]) == 1
    assert offload.stats.demoted_to == {"host": 1}
    engine.check_invariants()
    engine.close()
