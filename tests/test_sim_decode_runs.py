"""Uniform decode runs (kvpilot.engine.decode_run) change nothing but the simulator's speed.

Each workload is simulated twice on the same seed: stepping the engine one step at a time,
and with decode runs. Every request's token times, every inter-token latency, the telemetry
samples, the counters, and the final memory state (radix tree with its access times, block
tables, free list) must be identical.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.decode_run import advance_decode_run
from kvpilot.engine.engine import Engine
from kvpilot.memory.radix import RadixNode
from kvpilot.sim import runner as runner_module
from kvpilot.sim.build import SimSetup, build_engine
from kvpilot.sim.drivers import AgentDriver
from kvpilot.sim.profile import StepProfile
from kvpilot.sim.runner import SimulatedRunner
from kvpilot.sim.simulator import Simulator
from kvpilot.sim.workload import WorkloadConfig

# The module (the package's `batch_shape` is the function of that name).
batch_shape_module = importlib.import_module("kvpilot.sim.batch_shape")


def workload(seed: int, agents: int, forks: float, wait: float, turns: int) -> WorkloadConfig:
    return WorkloadConfig.from_dict(
        {
            "seed": seed,
            "arrival": {"concurrent": agents, "ramp_s": 3},
            "trajectory": {
                "turns": {"dist": "uniform", "low": 1, "high": turns},
                "task_tokens": {"dist": "lognormal", "median": 150, "sigma": 0.8, "max": 900},
                "observation_tokens": {"dist": "lognormal", "median": 60, "sigma": 1.0},
                "output_tokens": {"dist": "lognormal", "median": 60, "sigma": 0.8, "max": 400},
                "max_context_tokens": 3000,
            },
            "shared_prefix": {"system_tokens": 100, "tool_tokens": 37},
            "tools": {
                "fast": {"weight": 2, "wait": {"dist": "lognormal", "median": wait, "sigma": 1}},
                "slow": {
                    "weight": 1,
                    "wait": {"dist": "lognormal", "median": 6 * wait, "sigma": 0.5},
                },
            },
            "pause_hints": "median",
            "branching": {"probability": forks, "fork_factor": 2, "branch_turns": 2},
        }
    )


def simulate(
    setup: SimSetup, wl: WorkloadConfig, policy: str, runs: bool, interval: float = 0.7
) -> tuple[Simulator, Engine]:
    engine, _ = build_engine(setup, wl.vocab_size, policy)
    sim = Simulator(
        engine, duration_s=setup.duration_s, sample_interval_s=interval, decode_runs=runs
    )
    sim.run(AgentDriver(wl, engine.max_model_len))
    engine.check_invariants()
    return sim, engine


def count_steps(engine: Engine) -> list[int]:
    """Count the engine's `step` calls from now on, in the one-item list returned."""
    calls = [0]
    original = engine.step

    def counted(**kwargs: Any) -> Any:
        calls[0] += 1
        return original(**kwargs)

    engine.step = counted  # type: ignore[method-assign]
    return calls


def radix_dump(engine: Engine) -> list[Any]:
    out: list[Any] = []

    def walk(node: RadixNode, depth: int) -> None:
        for key in sorted(node.children):
            child = node.children[key]
            blocks = {tier.value: list(ids) for tier, ids in child.blocks.items()}
            out.append((depth, bytes(child.tokens), blocks, child.last_access, child.lock_count))
            walk(child, depth + 1)

    for salt, root in sorted(engine.kv.radix.roots().items(), key=lambda kv: str(kv[0])):
        out.append(("root", salt))
        walk(root, 0)
    return out


def state(sim: Simulator, engine: Engine) -> dict[str, Any]:
    runner = engine.executor
    assert isinstance(runner, SimulatedRunner)
    turns = sim.turns
    trajectories = {
        t.traj_id: (list(t.tokens), list(t.block_table), t.num_computed_tokens, t.locked_tokens)
        for t in engine.kv.trajectories.values()
    }
    stats = engine.stats
    return {
        "arrival": np.asarray(turns.arrival_s),
        "first_token": np.asarray(turns.first_token_s),
        "finish": np.asarray(turns.finish_s),
        "tokens": (list(turns.prompt_tokens), list(turns.cached_tokens), list(turns.output_tokens)),
        "itl": np.asarray(sim.itl_s),
        "samples": sim.samples.as_arrays(),
        "clock": engine.clock.now(),
        "counters": (
            stats.steps,
            stats.prefill_tokens,
            stats.decode_tokens,
            stats.generated_tokens,
            stats.prompt_tokens,
            stats.cached_tokens,
            runner.steps,
            runner.recomputed_tokens,
            engine.scheduler.num_preemptions,
            dict(engine.offload.stats.decisions),
            dict(engine.offload.stats.bytes_moved),
        ),
        "times": (stats.step_time_s, runner.busy_s, engine.offload.stats.idle_gb_s),
        "trajectories": trajectories,
        "free": list(engine.kv.device._free),
        "radix": radix_dump(engine),
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    # To the last bit: a run makes the same float additions, in the same order, as stepping.
    for key in ("arrival", "first_token", "finish", "itl"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    for name, values in a["samples"].items():
        np.testing.assert_array_equal(values, b["samples"][name], err_msg=name)
    for key in ("clock", "times", "tokens", "counters", "trajectories", "free", "radix"):
        assert a[key] == b[key], key


def setup_for(blocks: int, tau: float, budget: int, caching: bool) -> SimSetup:
    return SimSetup(
        model="llama-3-8b",
        node="h100",
        kv_blocks=blocks,
        duration_s=60.0,
        engine=EngineConfig.from_kwargs(
            max_num_seqs=64,
            max_num_batched_tokens=budget,
            max_prefill_chunk=256,
            tau_high=tau,
            enable_prefix_caching=caching,
        ),
    )


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    agents=st.integers(1, 24),
    forks=st.sampled_from([0.0, 0.3]),
    wait=st.sampled_from([0.2, 1.5, 8.0]),
    turns=st.integers(1, 6),
    blocks=st.sampled_from([220, 600, 4000]),
    tau=st.sampled_from([0.6, 0.9]),
    budget=st.sampled_from([24, 512]),
    policy=st.sampled_from(["breakeven", "retain", "offload-host", "drop", "lru"]),
    caching=st.booleans(),
)
def test_decode_runs_give_the_same_simulation_as_single_steps(
    seed: int,
    agents: int,
    forks: float,
    wait: float,
    turns: int,
    blocks: int,
    tau: float,
    budget: int,
    policy: str,
    caching: bool,
) -> None:
    setup = setup_for(blocks, tau, budget, caching)
    wl = workload(seed, agents, forks, wait, turns)
    stepped = state(*simulate(setup, wl, policy, runs=False))
    jumped = state(*simulate(setup, wl, policy, runs=True))
    assert_same(stepped, jumped)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    agents=st.integers(4, 16),
    forks=st.sampled_from([0.0, 0.3]),
    blocks=st.sampled_from([220, 4000]),
    policy=st.sampled_from(["breakeven", "retain", "drop"]),
)
def test_decode_runs_on_a_calibrated_profile_with_shared_kv_give_the_same_simulation(
    tmp_path_factory: pytest.TempPathFactory,
    seed: int,
    agents: int,
    forks: float,
    blocks: int,
    policy: str,
) -> None:
    """A measured profile reads shared KV cheaper (the agents share a system prompt, forks
    share their parent's context): a run's steps charge the shared KV its first step reads,
    stepping counts it at every step from the block tables; both must agree."""
    path = tmp_path_factory.mktemp("profile") / "p.json"
    coefficients = (1e-3, 2e-5, 3e-4, 1e-7, 1e-9, 6e-7)
    StepProfile("t", "cpu", "float32", 16, coefficients, 1e-5, 20, 1, 0, max_model_len=4096).save(
        path
    )
    setup = dataclasses.replace(setup_for(blocks, 0.9, 512, True), profile=path)
    wl = workload(seed, agents, forks, 1.5, 4)
    counted: list[int] = []
    original = runner_module.shared_kv_tokens

    def counting(*args: Any) -> int:
        counted.append(original(*args))
        return counted[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner_module, "shared_kv_tokens", counting)  # decode runs
        patch.setattr(batch_shape_module, "shared_kv_tokens", counting)  # single steps
        stepped = state(*simulate(setup, wl, policy, runs=False))
        assert max(counted) > 0  # the steps did share KV
        jumped = state(*simulate(setup, wl, policy, runs=True))
    assert_same(stepped, jumped)


def test_decode_runs_replace_most_steps_under_a_decode_heavy_load() -> None:
    setup = setup_for(4000, 0.9, 512, True)
    wl = workload(7, 16, 0.0, 1.5, 4)
    engine, _ = build_engine(setup, wl.vocab_size, "breakeven")
    calls = count_steps(engine)
    sim = Simulator(engine, duration_s=setup.duration_s)
    sim.run(AgentDriver(wl, engine.max_model_len))
    assert engine.stats.steps > 5 * calls[0]  # most steps were advanced in runs


@pytest.mark.parametrize("policy", ["breakeven", "offload-host"])
def test_samples_taken_inside_runs_read_what_single_steps_show(policy: str) -> None:
    # Every 50 ms: most samples fall inside runs (KV usage, ITLs, residency all move there).
    setup = setup_for(600, 0.9, 512, True)
    wl = workload(3, 12, 0.3, 1.5, 4)
    stepped = state(*simulate(setup, wl, policy, runs=False, interval=0.05))
    jumped = state(*simulate(setup, wl, policy, runs=True, interval=0.05))
    assert len(jumped["samples"]["time_s"]) > 900  # about one per step
    assert_same(stepped, jumped)


def test_samples_do_not_cut_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpilot.sim import simulator

    runs = 0

    def counted(*args: Any, **kwargs: Any) -> int:
        nonlocal runs
        k = advance_decode_run(*args, **kwargs)
        runs += k > 0
        return k

    monkeypatch.setattr(simulator, "advance_decode_run", counted)
    setup = setup_for(4000, 0.9, 512, True)
    wl = workload(7, 16, 0.0, 1.5, 4)
    counts = []
    for interval in (1e6, 0.02):
        runs = 0
        sim, _ = simulate(setup, wl, "breakeven", runs=True, interval=interval)
        counts.append(runs)
    assert len(sim.samples.time_s) > 2000
    assert counts[1] <= counts[0] * 1.01  # 3,000 samples, no more runs


def test_a_look_that_moves_the_clock_inside_a_run_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A run jumps the clock to the steps it visits: anything else moving it would shift them.
    look = Simulator.look

    def moving(self: Simulator) -> None:
        look(self)
        self.clock.advance(1e-6)

    monkeypatch.setattr(Simulator, "look", moving)
    with pytest.raises(AssertionError, match="clock moved inside a decode run"):
        simulate(
            setup_for(600, 0.9, 512, True),
            workload(3, 12, 0.3, 1.5, 4),
            "breakeven",
            runs=True,
            interval=0.05,
        )


def test_a_run_stops_before_the_next_event_and_before_a_sequence_finishes() -> None:
    setup = setup_for(4000, 0.9, 512, True)
    engine, _ = build_engine(setup, 32000)
    from kvpilot.engine.sampling import SamplingParams

    engine.add_request([5] * 40, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request([6] * 70, SamplingParams(max_tokens=12, ignore_eos=True))
    assert advance_decode_run(engine, until=1e9) == 0  # prefill first: not a decode step
    engine.step()
    t = engine.clock.now()
    # Each decode step of this batch takes the same ~16 ms; stop before t + 0.05 s.
    k = advance_decode_run(engine, until=t + 0.05)
    step_s = (engine.clock.now() - t) / k
    assert k >= 2 and engine.clock.now() - step_s < t + 0.05 <= engine.clock.now() + step_s
    # The second request has 12 - 1 - k tokens to go; a run leaves its last one to step().
    k2 = advance_decode_run(engine, until=1e9)
    seq = engine.scheduler.running[1]
    assert len(seq.output_token_ids) == 11 and k2 == 11 - 1 - k
    assert advance_decode_run(engine, until=1e9) == 0


def two_session_turns(finished: list[Any] | None) -> tuple[Engine, list[Any]]:
    """Two session turns (30 and 12 tokens to generate) prefilled; then decode runs, or single
    steps when ``finished`` is None, until both are done. Returns the engine and the outputs
    in the order they finished."""
    from kvpilot.engine.sampling import SamplingParams

    engine, _ = build_engine(setup_for(4000, 0.9, 512, True), 32000)
    outputs: list[Any] = []
    for prompt, max_tokens in (([5] * 40, 30), ([6] * 70, 12)):
        session = engine.open_session()
        session.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    outputs += [o for o in engine.step(snapshots=False) if o.finished]
    while engine.has_unfinished():
        if finished is not None:
            k = advance_decode_run(engine, until=1e9, finished=finished)
            if k:
                outputs += finished
                finished.clear()
                continue
        outputs += [o for o in engine.step(snapshots=False) if o.finished]
    engine.check_invariants()
    return engine, outputs


def test_a_run_may_end_with_the_step_that_finishes_session_turns() -> None:
    stepped, by_step = two_session_turns(None)
    jumped, by_run = two_session_turns([])
    assert [o.request_id for o in by_run] == [o.request_id for o in by_step]
    assert by_run == by_step  # same tokens, times, finish reasons
    assert jumped.stats.steps == stepped.stats.steps
    assert jumped.stats.itl_s == stepped.stats.itl_s
    assert jumped.stats.generated_tokens == stepped.stats.generated_tokens
    assert jumped.clock.now() == stepped.clock.now()


def test_a_run_finishes_a_session_turn_in_its_last_step_only_when_asked() -> None:
    from kvpilot.engine.sampling import SamplingParams

    engine, _ = build_engine(setup_for(4000, 0.9, 512, True), 32000)
    session = engine.open_session()
    rid = session.submit([5] * 40, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()
    assert advance_decode_run(engine, until=1e9) == 10  # the 12th token is left to step()
    finished: list[Any] = []
    assert advance_decode_run(engine, until=1e9, finished=finished) == 0  # one step: no run
    engine.step()
    assert not engine.has_unfinished()
    engine.pop_output(rid)

    rid = session.submit([7] * 9, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()
    assert advance_decode_run(engine, until=1e9, finished=finished) == 11
    assert [o.request_id for o in finished] == [rid] and finished[0].finished
    assert len(finished[0].token_ids) == 12 and not engine.has_unfinished()


def test_a_run_leaves_finishing_a_request_without_session_to_step() -> None:
    from kvpilot.engine.sampling import SamplingParams

    engine, _ = build_engine(setup_for(4000, 0.9, 512, True), 32000)
    engine.add_request([5] * 40, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()
    finished: list[Any] = []
    assert advance_decode_run(engine, until=1e9, finished=finished) == 10
    assert not finished and engine.has_unfinished()


def test_the_clock_moves_only_from_where_a_run_left_it() -> None:
    from kvpilot.engine.clock import VirtualClock

    clock = VirtualClock(1.0)
    clock.move(1.0, 1.5)
    assert clock.now() == 1.5
    clock.advance(1e-9)  # something else moved it: the run's next jump must notice
    with pytest.raises(AssertionError, match="clock moved inside a decode run"):
        clock.move(1.5, 2.0)


def test_a_run_visits_no_step_for_polls_when_none_is_due() -> None:
    from kvpilot.engine.decode_run import _first_poll

    starts = [0.0, 0.1, 0.2, 0.3, 0.4]
    assert _first_poll(starts, math.inf, 0, 4) == 4  # nothing due: no step polls
    assert _first_poll(starts, 0.2, 0, 4) == 2  # the step starting at the poll time polls
    assert _first_poll(starts, 0.2, 3, 4) == 3  # one after another: from where it stands
    assert _first_poll(starts, 9.0, 0, 4) == 4


def test_the_engine_holds_its_invariants_at_every_look_inside_a_run() -> None:
    # A run counts each sequence's KV as computed to its end at once, then takes its blocks
    # step by step: at a look the counts are those of the look's step, every table covering
    # them, every locked path within them.
    setup = setup_for(600, 0.9, 512, True)
    wl = workload(3, 12, 0.3, 1.5, 4)
    engine, _ = build_engine(setup, wl.vocab_size, "breakeven")
    calls = count_steps(engine)
    looked = 0

    def check(_now: float) -> None:
        nonlocal looked
        engine.check_invariants()
        looked += 1

    sim = Simulator(engine, duration_s=setup.duration_s, sample_interval_s=0.05, on_progress=check)
    sim.run(AgentDriver(wl, engine.max_model_len))
    assert looked > 900
    assert engine.stats.steps > 5 * calls[0]  # most looks fell inside runs
