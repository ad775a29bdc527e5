"""The offload manager's and tier mover's audits: every pin belongs to a move or load in flight,
every pause record to an open session, every pending timer to a record. Torch-free: the
simulator's host tier carries the moves."""

from __future__ import annotations

import pytest

from kvpilot.engine import Engine, SamplingParams
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.tier_stats import PauseState
from kvpilot.memory import Tier
from kvpilot.sim.build import SimSetup, build_engine

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def tiered(policy: str) -> Engine:
    setup = SimSetup(
        model="llama-3-8b",
        node="h100",
        kv_blocks=256,
        host_kv_bytes_per_device=64 * 16 * 131072,  # 64 blocks of llama-3-8b KV
        engine=EngineConfig.from_kwargs(pause_policy=policy),
    )
    engine, _ = build_engine(setup, 32000)
    return engine


def paused_session(engine: Engine, wait_s: float = 600.0) -> str:
    session = engine.open_session()
    session.generate(list(range(1, 200)), PARAMS)
    session.pause(expected_wait_s=wait_s, tool="pytest")
    return session.session_id


def test_the_audit_holds_while_copies_are_in_flight_and_after() -> None:
    engine = tiered("offload-host")
    sid = paused_session(engine)
    record = engine.offload.record_for(sid)
    assert record is not None and record.state is PauseState.OFFLOADED
    assert engine.offload.mover.moves, "the copy to host is in flight"
    engine.check_invariants()  # pins and move locks of the move in flight add up
    while engine.offload.busy():
        engine.step()
        engine.check_invariants()
    assert engine.kv.radix.cached_blocks(Tier.HOST) > 0
    assert not any(engine.kv.residency.pins.values())


def test_a_stray_pin_is_caught() -> None:
    engine = tiered("offload-host")
    paused_session(engine)
    engine.kv.residency.pin(Tier.DEVICE, [engine.kv.device.allocate(1)[0]], take_reference=False)
    with pytest.raises(AssertionError, match="do not match the moves and loads"):
        engine.offload.mover.check_invariants()


def test_a_record_of_a_closed_session_is_caught() -> None:
    engine = tiered("retain")
    sid = paused_session(engine)
    engine.check_invariants()
    with pytest.raises(AssertionError, match="not open"):
        engine.offload.check_invariants(open_sessions=set())
    assert sid in engine.sessions


def test_a_timer_without_a_record_is_caught() -> None:
    engine = tiered("offload-host")
    sid = paused_session(engine)
    assert sid in engine.offload.timers.sessions()  # the prefetch
    engine.offload.records.pop(sid)
    with pytest.raises(AssertionError, match="without a pause record"):
        engine.offload.check_invariants(engine.sessions)


def test_closing_a_paused_session_leaves_no_record_nor_timer() -> None:
    engine = tiered("offload-host")
    sid = paused_session(engine)
    engine.sessions[sid].close()
    assert engine.offload.record_for(sid) is None
    assert sid not in engine.offload.timers.sessions()
    engine.check_invariants()


def test_the_pause_tallies_hold_through_offload_prefetch_and_resume() -> None:
    engine = tiered("offload-host")
    sid = paused_session(engine, wait_s=5.0)
    record = engine.offload.record_for(sid)
    assert record is not None and record.prefetch_at is not None
    engine.check_invariants()
    states = [record.state]
    engine.clock.advance_to(record.prefetch_at + 1e-6)
    while engine.offload.busy() or record.state is not PauseState.PREFETCHED:
        engine.step()
        engine.check_invariants()  # every state change went through the pause book
        states.append(record.state)
        assert len(states) < 100, states
    assert PauseState.PREFETCHED in states
    engine.sessions[sid].generate([7, 8, 9], PARAMS)  # resumes: the record leaves the book
    assert engine.offload.record_for(sid) is None
    engine.check_invariants()
