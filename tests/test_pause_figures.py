"""What a pause tells its policy: the tokens and blocks only its session holds (summed in
one pass over its exclusive nodes), and a tool's recent waits for the policies that read
them, and only for them (`PausePolicy.reads_tool_waits`: copying them into every pause's
inputs for the rule, which never reads them, is work nobody uses)."""

from __future__ import annotations

import random

import pytest

from kvpilot.engine import Engine, EngineConfig, SamplingParams, VirtualClock
from kvpilot.engine.offload import OffloadManager
from kvpilot.policy.breakeven import PauseDecision, PauseInputs, decide_pause
from kvpilot.policy.pause import POLICY_NAMES, make_pause_policy

from fake_executor import FakeExecutor

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
READERS = {"infercept", "infercept-oracle", "continuum"}  # policies/baselines.py


def engine_with(policy: str) -> Engine:
    config = EngineConfig.from_kwargs(pause_policy=policy)
    return Engine(FakeExecutor(256, 16), config, vocab_size=500, clock=VirtualClock())


def second_pause_inputs(engine: Engine, tool: str = "pytest") -> PauseInputs:
    """The inputs of a session's second pause on ``tool``, after one wait of it was seen."""
    rng = random.Random(0)
    session = engine.open_session()
    for wait in (2.5, 4.0):
        session.generate([rng.randrange(500) for _ in range(40)], PARAMS)
        session.pause(expected_wait_s=wait, tool=tool)
        engine.clock.advance(wait)  # type: ignore[attr-defined]
    record = session.last_pause
    assert record is not None
    return record.inputs


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_tool_waits_reach_the_policies_that_read_them(name: str) -> None:
    assert make_pause_policy(name).reads_tool_waits == (name in READERS)
    inputs = second_pause_inputs(engine_with(name))
    assert inputs.tool_waits == ((2.5,) if name in READERS else ())


class Unsaid:
    """A policy that does not say whether it reads the waits: it is given them."""

    name = "unsaid"

    def decide(self, inputs: PauseInputs) -> PauseDecision:
        return decide_pause(inputs)

    def lease_s(self, inputs: PauseInputs) -> float:
        return float("inf")


def test_a_policy_that_does_not_say_is_given_the_waits() -> None:
    engine = engine_with("breakeven")
    kv, config, clock = engine.kv, engine.config.pause, engine.clock.now
    assert OffloadManager(kv, config, clock, policy=Unsaid()).tool_waits_read
    assert not OffloadManager(kv, config, clock).tool_waits_read  # breakeven says it does not


def test_a_pause_prices_what_only_its_session_holds() -> None:
    engine = engine_with("retain")
    rng = random.Random(1)
    prompt = [rng.randrange(500) for _ in range(100)]
    parent = engine.open_session()
    parent.generate(prompt, PARAMS)
    bb = engine.offload.block_bytes
    alone = parent.pause(expected_wait_s=1.0)
    traj = parent.traj
    record = parent.last_pause
    assert record is not None and record.decision == alone
    # Alone, it holds its whole path and its private tail.
    assert record.inputs.num_tokens == traj.num_computed_tokens
    assert record.inputs.kv_bytes == len(traj.block_table) * bb
    child = parent.fork()[0]
    child.generate([rng.randrange(500) for _ in range(50)], PARAMS)
    child.pause(expected_wait_s=1.0)
    record = child.last_pause
    assert record is not None
    # The shared history is the parent's too: the child prices only what follows it.
    shared = traj.num_computed_tokens // 16 * 16
    assert record.inputs.num_tokens == child.traj.num_computed_tokens - shared
    assert record.inputs.kv_bytes == (len(child.traj.block_table) - shared // 16) * bb


def test_a_pause_is_told_what_pause_inputs_works_out_from_its_exclusive_nodes() -> None:
    """`pause` sums its exclusive device nodes in the walk that finds them
    (`OffloadManager._exclusive_device`): the same inputs as `pause_inputs` given the nodes
    `exclusive_device_nodes` finds, alone, forked, and beside a retained sibling."""
    engine = engine_with("retain")
    offload = engine.offload
    rng = random.Random(2)
    parent = engine.open_session()
    parent.generate([rng.randrange(500) for _ in range(70)], PARAMS)
    children = parent.fork(2)
    sessions = [parent, *children]
    for turn in range(3):
        for i, session in enumerate(sessions):
            if turn:
                session.generate([rng.randrange(500) for _ in range(9 + 13 * i)], PARAMS)
            traj = session.traj
            nodes = offload.exclusive_device_nodes(traj)
            wait = 0.5 + i + turn
            expected = offload.pause_inputs(traj, nodes, wait, "tool", engine.clock.now())
            session.pause(expected_wait_s=wait, tool="tool")
            record = session.last_pause
            assert record is not None and record.inputs == expected
            engine.clock.advance(0.25)  # type: ignore[attr-defined]
