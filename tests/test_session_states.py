"""What each agent session is doing (the `kvpilot_sessions` gauge and GET /v1/sessions)."""

from __future__ import annotations

import random

from kvpilot.engine import Engine, EngineConfig, SamplingParams, VirtualClock
from kvpilot.server.session_states import session_state_counts, session_states

from fake_executor import FakeExecutor


def make_engine() -> Engine:
    config = EngineConfig.from_kwargs(pause_policy="retain", max_num_seqs=1)
    executor = FakeExecutor(256, 16)
    return Engine(executor, config, vocab_size=500, max_model_len=4096, clock=VirtualClock())


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(40)]


def test_sessions_are_running_waiting_paused_or_idle() -> None:
    engine = make_engine()
    paused, running, waiting, idle = (engine.open_session() for _ in range(4))
    paused.generate(prompt(0), SamplingParams(max_tokens=2))
    paused.pause(expected_wait_s=30.0, tool="pytest")
    running.submit(prompt(1), SamplingParams(max_tokens=50))
    engine.step()  # one sequence at a time: the first submitted runs, the next waits
    waiting.submit(prompt(2), SamplingParams(max_tokens=50))
    engine.step()
    ids = [s.session_id for s in (paused, running, waiting, idle)]
    assert list(session_states(engine, ids).values()) == ["paused", "running", "waiting", "idle"]
    assert session_state_counts(engine) == {"running": 1, "waiting": 1, "paused": 1, "idle": 1}
    idle.close()
    assert idle.session_id not in session_states(engine, ids)
    assert session_state_counts(engine)["idle"] == 0


def test_a_paused_session_whose_next_turn_arrived_is_no_longer_paused() -> None:
    engine = make_engine()
    session = engine.open_session()
    session.generate(prompt(0), SamplingParams(max_tokens=2))
    session.pause(expected_wait_s=30.0)
    session.submit(prompt(1), SamplingParams(max_tokens=50))
    assert session_states(engine, [session.session_id]) == {session.session_id: "waiting"}
    assert session_state_counts(engine) == {"running": 0, "waiting": 1, "paused": 0, "idle": 0}
    engine.step()
    assert session_states(engine, [session.session_id]) == {session.session_id: "running"}
    assert session_state_counts(engine) == {"running": 1, "waiting": 0, "paused": 0, "idle": 0}
