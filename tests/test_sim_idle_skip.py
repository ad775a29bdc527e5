"""Idle steps skipped while only simulated copies run (kvpilot.engine.idle_skip) change
nothing but the simulator's speed.

Each workload, with host and disk tiers and pauses that move state, is simulated twice on
the same seed: idling one `IDLE_STEP_S` step at a time while copies run, and skipping those
steps. Every request's token times, the telemetry, the counters, the pause decisions and the
final memory state must be identical (`test_sim_decode_runs.assert_same`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sim_decode_runs import assert_same, count_steps, state, workload

from kvpilot.engine.clock import VirtualClock
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.engine import Engine
from kvpilot.engine.idle_skip import IDLE_STEP_S, IdleSkipper, next_completion
from kvpilot.engine.sampling import SamplingParams
from kvpilot.sim.build import SimSetup, build_engine
from kvpilot.sim.drivers import AgentDriver
from kvpilot.sim.simulator import Simulator
from kvpilot.sim.transport import SimulatedTransfer


def tiered_setup(blocks: int, host_blocks: int, disk_blocks: int, tau: float) -> SimSetup:
    setup = SimSetup(
        model="llama-3-70b",
        node="8xh100",
        tp=8,
        kv_blocks=blocks,
        duration_s=40.0,
        engine=EngineConfig.from_kwargs(
            max_num_seqs=64, max_num_batched_tokens=512, max_prefill_chunk=256, tau_high=tau
        ),
    )
    per_block = 16 * setup.geometry().bytes_per_token(8)
    return dataclasses.replace(
        setup,
        host_kv_bytes_per_device=host_blocks * per_block,
        disk_kv_bytes_per_device=disk_blocks * per_block,
    )


def simulate(
    setup: SimSetup, seed: int, agents: int, wait: float, policy: str, skips: bool
) -> tuple[Simulator, Engine, int]:
    wl = workload(seed, agents, 0.0, wait, 5)
    engine, _ = build_engine(setup, wl.vocab_size, policy)
    calls = count_steps(engine)
    sim = Simulator(engine, duration_s=setup.duration_s, sample_interval_s=0.7, idle_skips=skips)
    sim.run(AgentDriver(wl, engine.max_model_len))
    engine.check_invariants()
    return sim, engine, calls[0]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    agents=st.integers(2, 16),
    wait=st.sampled_from([0.05, 0.5, 4.0]),
    blocks=st.sampled_from([300, 900]),
    host_blocks=st.sampled_from([0, 50, 2000]),
    disk_blocks=st.sampled_from([0, 4000]),
    tau=st.sampled_from([0.6, 0.9]),
    policy=st.sampled_from(["breakeven", "offload-host", "offload-disk", "oracle", "lru"]),
)
def test_skipped_idle_steps_give_the_same_simulation_as_idling_step_by_step(
    seed: int,
    agents: int,
    wait: float,
    blocks: int,
    host_blocks: int,
    disk_blocks: int,
    tau: float,
    policy: str,
) -> None:
    setup = tiered_setup(blocks, host_blocks, disk_blocks, tau)
    stepped = simulate(setup, seed, agents, wait, policy, skips=False)
    skipped = simulate(setup, seed, agents, wait, policy, skips=True)
    assert_same(state(*stepped[:2]), state(*skipped[:2]))
    assert skipped[2] <= stepped[2]


def test_skipping_replaces_most_idle_steps_while_disk_copies_run() -> None:
    setup = tiered_setup(300, 50, 4000, 0.9)
    stepped = simulate(setup, 3, 3, 0.5, "offload-disk", skips=False)
    skipped = simulate(setup, 3, 3, 0.5, "offload-disk", skips=True)
    assert_same(state(*stepped[:2]), state(*skipped[:2]))
    assert stepped[1].offload.stats.bytes_moved["device_to_disk"] > 0
    assert skipped[2] * 3 < stepped[2]  # most engine steps were idle ones, now skipped


def test_the_next_completion_is_the_earliest_and_unknown_for_a_real_copy() -> None:
    from concurrent.futures import Future

    clock = VirtualClock()
    a, b = SimulatedTransfer(clock, 2.5, 1.0), SimulatedTransfer(clock, 1.5, 1.0)
    assert next_completion([a, b]) == 1.5
    assert next_completion([]) == math.inf
    assert next_completion([a, Future()]) is None


def test_a_skip_stops_on_the_idle_grid_just_before_the_first_completion() -> None:
    setup = tiered_setup(2000, 2000, 0, 0.9)
    engine, _ = build_engine(setup, 32000, "offload-host")
    session = engine.open_session()
    prompt = [1000 + i % 20000 for i in range(16000)]
    session.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    session.pause(expected_wait_s=60.0)
    (copy,) = engine.offload.mover.in_flight()
    finish = next_completion([copy])
    assert finish is not None
    skipper = IdleSkipper(engine)
    now = engine.clock.now()
    assert skipper.skip(until=1e9) == 0  # the first idle step: the state may still change
    engine.clock.sleep(IDLE_STEP_S)
    # ``until`` (the caller's next event) bounds a skip as a completion does.
    assert skipper.skip(until=now + 4.5 * IDLE_STEP_S) == 3
    steps = 4 + skipper.skip(until=1e9)
    t = engine.clock.now()
    assert steps > 10  # a copy of 16k tokens' KV takes many idle steps
    assert t < finish <= t + IDLE_STEP_S + 1e-9
    grid = now
    for _ in range(steps):
        grid += IDLE_STEP_S
    assert t == grid  # the same float additions as idling step by step


def test_the_loop_moves_on_when_rounding_leaves_the_clock_where_it_was() -> None:
    # Measured on bench_pause's simulated node: the next event was a hair past the clock as
    # the loop reads it (clock - t0), and adding the difference rounded back: the loop spun.
    engine, _ = build_engine(SimSetup(model="llama-3-8b", node="h100", kv_blocks=64), 32000)
    sim = Simulator(engine, duration_s=100.0)
    sim.t0 = 0.003159771428571429
    engine.clock.advance_to(8.001619025669093)  # type: ignore[attr-defined]
    before = engine.clock.now()
    sim._wait_until(7.998459254240522)
    assert engine.clock.now() > before


MINISWE = Path(__file__).resolve().parents[2] / "shared/traces/lmcache-agent-trace/miniswe"


@pytest.mark.skipif(not MINISWE.exists(), reason="the miniswe trace is not here")
def test_bench_pause_simulated_node_is_the_same_with_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    # The case that showed a step is not idle just because it ran nothing: a resume started
    # a host load, and the next idle step reclaimed memory (usage had crossed tau_high).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import pause_sim
    import pause_workload

    from kvpilot.trace.waits import WaitModel

    monkeypatch.setattr(pause_workload, "TRACES", MINISWE)
    waits = WaitModel(0.01, 0.1, seed=0)
    sessions = pause_workload.load_sessions(20, pause_sim.MAX_CONTEXT_TOKENS, waits, 32000)
    work = pause_workload.working_set_tokens(sessions)
    base = SimSetup(model=pause_sim.MODEL, node=pause_sim.NODE, tp=pause_sim.TP)
    per_token = base.geometry().bytes_per_token(pause_sim.TP)
    setup = dataclasses.replace(
        base,
        kv_blocks=int(work * 0.35) // 16,
        host_kv_bytes_per_device=work * 0.4 * per_token,
        disk_kv_bytes_per_device=work * 4 * per_token,
        engine=EngineConfig.from_kwargs(max_num_seqs=256, max_num_batched_tokens=2048),
        duration_s=3600.0,
    )
    runs = []
    for skips in (False, True):
        engine, _ = build_engine(setup, 32000, "breakeven")
        sim = Simulator(engine, duration_s=setup.duration_s, idle_skips=skips)
        sim.run(pause_sim.PauseReplayDriver(sessions, told_truth=False))
        runs.append(state(sim, engine))
    assert_same(*runs)
