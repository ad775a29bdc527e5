"""The simulator drives the real engine on virtual time: analytic capacity checks, event-loop
behaviour (tool waits, forks, layouts, stalls), determinism and policies."""

from __future__ import annotations

from array import array
from typing import Any

import pytest

from kvpilot.engine.clock import VirtualClock
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.engine import Engine
from kvpilot.engine.sampling import SamplingParams
from kvpilot.errors import ConfigError
from kvpilot.sim.build import SimSetup, build_engine, kv_pool_blocks, run_simulation
from kvpilot.sim.drivers import AgentDriver, ReplayDriver
from kvpilot.sim.policies import apply_policy, resolve_policy
from kvpilot.sim.profile import CalibratedCostModel, StepProfile
from kvpilot.sim.replay import ReplayCall, ReplaySession
from kvpilot.sim.runner import SimulatedRunner
from kvpilot.sim.simulator import Simulator
from kvpilot.sim.workload import WorkloadConfig
from kvpilot.sizing.capacity import max_concurrency
from kvpilot.sizing.geometry import resolve_geometry
from kvpilot.sizing.hardware import parse_node

FOREVER = {"forever": {"weight": 1, "wait": 1e9}}


def workload(**sections: Any) -> WorkloadConfig:
    base: dict[str, Any] = {
        "arrival": {"concurrent": 4, "ramp_s": 0},
        "trajectory": {
            "turns": 3,
            "task_tokens": 200,
            "observation_tokens": 100,
            "output_tokens": 20,
        },
        "shared_prefix": {"system_tokens": 64, "tool_tokens": 64},
        "tools": {"bash": {"weight": 1, "wait": 2.0}},
        "branching": {"probability": 0},
    }
    base.update(sections)
    return WorkloadConfig.from_dict(base)


def setup(**kw: Any) -> SimSetup:
    engine = kw.pop("engine", EngineConfig.from_kwargs(max_num_seqs=256))
    kw.setdefault("model", "llama-3-8b")
    kw.setdefault("node", "h100")
    kw.setdefault("kv_blocks", 4000)
    kw.setdefault("duration_s", 120.0)
    return SimSetup(engine=engine, **kw)


def capacity_run(shared: int, blocks: int = 1000, tau: float = 0.9) -> tuple[int, int]:
    context, output = 1000, 24
    wl = workload(
        arrival={"concurrent": 60, "ramp_s": 0},
        trajectory={
            "turns": 2,
            "task_tokens": context - shared,
            "observation_tokens": 1,
            "output_tokens": output,
        },
        shared_prefix={"system_tokens": shared, "tool_tokens": 0},
        tools=FOREVER,
        pause_hints="none",
    )
    s = setup(
        model="llama-3-70b",
        node="8xh100",
        kv_blocks=blocks,
        host_kv_bytes_per_device=0,
        duration_s=600.0,
        engine=EngineConfig.from_kwargs(
            tau_high=tau, max_num_batched_tokens=4096, max_prefill_chunk=4096, max_num_seqs=256
        ),
    )
    result = run_simulation(s, wl)
    bpt = resolve_geometry("llama-3-70b").bytes_per_token(8)
    expected = max_concurrency(blocks * 16 * bpt, bpt, context, output, shared, 1 - tau)
    assert expected is not None
    return int(result.samples["resident"][-1]), expected


def test_unshared_trajectories_reach_the_plan_concurrency() -> None:
    reached, expected = capacity_run(shared=0)
    # Admission lets in one more trajectory while usage is still just below tau_high.
    assert expected <= reached <= expected + 1


def test_shared_prefix_trajectories_reach_equation_7() -> None:
    reached, expected = capacity_run(shared=512)
    cold_reached, _ = capacity_run(shared=0)
    assert expected <= reached <= expected + 1
    assert reached > 1.5 * cold_reached


def test_kv_pool_comes_from_plan_memory_budget() -> None:
    g, node = resolve_geometry("llama-3-70b"), parse_node("8xh100")
    blocks = kv_pool_blocks(g, node, 8)
    per_device = node.accelerator.hbm_bytes - g.weight_bytes(8) - 2.5e9
    assert blocks == int(per_device // (16 * g.bytes_per_token(8)))
    engine, _ = build_engine(SimSetup(tp=8), 32000)
    assert engine.kv.device.num_blocks == blocks


def test_default_tp_and_context_are_the_plans() -> None:
    setup = SimSetup()  # llama-3-70b on 8xh100: TP 4 x 2 replicas, as `kvpilot plan` says
    assert setup.tp_degree() == 4 and setup.model_len() == 131072
    long = SimSetup(model="mistral-7b", max_model_len=200_000)
    assert long.tp_degree() == 1 and long.model_len() == 32768
    assert any("exceeds mistral-7b's limit of 32,768" in w for w in long.warnings())


def test_each_turn_arrives_after_its_tool_wait() -> None:
    from kvpilot.sim.drivers import AgentDriver

    wl = workload(arrival={"concurrent": 1, "ramp_s": 0}, tools={"slow": {"weight": 1, "wait": 30}})
    engine, _ = build_engine(setup(), wl.vocab_size)
    sim = Simulator(engine, duration_s=200.0)
    driver = AgentDriver(wl, engine.max_model_len)
    sim.run(driver)
    arrivals, finishes = list(sim.turns.arrival_s), list(sim.turns.finish_s)
    # Closed loop, one trajectory at a time: 3 turns with two 30 s waits, then the next.
    assert len(arrivals) == 10
    for k in range(9):
        wait = 0.0 if k % 3 == 2 else 30.0
        assert arrivals[k + 1] == pytest.approx(finishes[k] + wait)
    assert driver.completed == 3 and driver.started == 4


def test_a_negative_delay_is_now_and_events_due_together_run_in_order() -> None:
    engine, _ = build_engine(setup(), 32000)
    sim = Simulator(engine, duration_s=10.0)
    ran: list[str] = []

    def first() -> None:
        ran.append("a")
        sim.after(-1.0, lambda: ran.append("c"))

    sim.at(2.0, first)
    sim.at(2.0, lambda: ran.append("b"))  # due with c (not a second before it): runs first
    sim.after(3.0, lambda: ran.append("d"))

    class Idle:
        def start(self, sim: Simulator) -> None:
            pass

        def counters(self) -> dict[str, int]:
            return {}

    sim.run(Idle())
    assert ran == ["a", "b", "c", "d"]


def test_engine_idles_through_tool_waits_without_spinning() -> None:
    wl = workload(
        arrival={"concurrent": 1, "ramp_s": 0}, tools={"human": {"weight": 1, "wait": 500}}
    )
    result = run_simulation(setup(duration_s=3600.0), wl)
    assert result.duration_s == pytest.approx(3600.0)
    assert result.busy_s < 30.0
    assert result.steps < 2000


def test_later_turns_hit_the_session_history() -> None:
    result = run_simulation(setup(), workload())
    # Turn k reuses the whole history; only the shared prefix is reused on first turns.
    assert result.hit_rate > 0.5
    assert result.radix_hit_rate > 0.5


def test_unstable_layout_breaks_the_prefix_cache() -> None:
    stable = run_simulation(setup(), workload())
    unstable = run_simulation(
        setup(),
        workload(shared_prefix={"system_tokens": 64, "tool_tokens": 64, "layout": "unstable"}),
    )
    assert unstable.hit_rate < 0.05 < stable.hit_rate
    assert unstable.prefill_tokens > 2 * stable.prefill_tokens


def test_volatile_token_after_the_tools_keeps_the_shared_prefix() -> None:
    after_tools = run_simulation(
        setup(),
        workload(
            shared_prefix={
                "system_tokens": 256,
                "tool_tokens": 256,
                "layout": "unstable",
                "volatile_after": "tools",
            }
        ),
    )
    head = run_simulation(
        setup(),
        workload(shared_prefix={"system_tokens": 256, "tool_tokens": 256, "layout": "unstable"}),
    )
    assert after_tools.hit_rate > head.hit_rate + 0.2


def test_forks_share_the_parent_and_run_their_branches() -> None:
    wl = workload(
        arrival={"concurrent": 2, "ramp_s": 0},
        branching={"probability": 1, "fork_factor": 3, "max_depth": 1, "branch_turns": 2},
    )
    result = run_simulation(setup(duration_s=300.0), wl)
    assert result.counters["forks"] > 0
    assert result.fork_copied_blocks > 0
    # every fork runs 3 branches of 2 turns besides the parent's own turn
    assert result.counters["calls"] >= result.counters["forks"] * 6


def test_poisson_arrivals_follow_the_rate() -> None:
    wl = workload(
        arrival={"rate_per_s": 0.5}, trajectory={"turns": 1, "task_tokens": 50, "output_tokens": 4}
    )
    result = run_simulation(setup(duration_s=400.0), wl)
    assert result.counters["trajectories_started"] == pytest.approx(200, rel=0.2)


def test_same_seed_same_result() -> None:
    a = run_simulation(setup(), workload()).summary()
    b = run_simulation(setup(), workload()).summary()
    for key in ("wall_s", "sim_s_per_wall_s"):
        a.pop(key)
        b.pop(key)
    assert a == b


def test_the_engine_stays_consistent_through_a_simulation() -> None:
    engine, _ = build_engine(setup(kv_blocks=300), 32000)
    sim = Simulator(engine, duration_s=200.0)
    from kvpilot.sim.drivers import AgentDriver

    wl = workload(
        arrival={"concurrent": 12, "ramp_s": 5},
        branching={"probability": 0.5, "fork_factor": 2, "max_depth": 1, "branch_turns": 1},
    )
    steps = 0
    original = engine.step

    def checked_step(**kwargs: Any) -> Any:
        nonlocal steps
        out = original(**kwargs)
        steps += 1
        if steps % 25 == 0:
            engine.check_invariants()
        return out

    engine.step = checked_step  # type: ignore[method-assign]
    sim.run(AgentDriver(wl, engine.max_model_len))
    engine.check_invariants()
    assert sim.turns.prompt_tokens


def test_memory_pressure_preempts_and_recomputes() -> None:
    wl = workload(
        arrival={"concurrent": 30, "ramp_s": 0},
        trajectory={"turns": 1, "task_tokens": 300, "output_tokens": 400},
    )
    result = run_simulation(setup(kv_blocks=300, duration_s=10.0), wl)
    assert result.preemptions > 0
    assert result.recomputed_tokens > 0


class _FillThenAsk:
    """Fills the pool with idle sessions, then asks for one more request, and nothing else."""

    def __init__(self, sessions: int) -> None:
        self.sessions = sessions
        self.done = 0

    def counters(self) -> dict[str, int]:
        return {}

    def start(self, sim: Simulator) -> None:
        self.sim = sim
        for i in range(self.sessions):
            session = sim.engine.open_session()
            sim.submit([i + 1] * 720, 4, self._turn_done, session=session)

    def _turn_done(self, _out: Any) -> None:
        self.done += 1
        if self.done == self.sessions:
            self.sim.submit([7] * 64, 4, lambda _o: None)


def test_idle_sessions_past_tau_high_give_way_to_new_work() -> None:
    engine, _ = build_engine(setup(kv_blocks=200), 32000)
    sim = Simulator(engine, duration_s=1e9)
    sim.run(_FillThenAsk(sessions=4))
    # Idle sessions hold 4 x 46 of 200 blocks (over tau_high = 0.9) and never return: the
    # engine demotes them rather than leave the new request waiting forever.
    assert not sim.stalled
    assert not engine.has_unfinished()
    assert sim.now < 10.0


def test_runner_advances_the_clock_by_the_cost_model() -> None:
    profile = StepProfile(
        "t", "cpu", "float32", 16, (1e-3, 1e-4, 1e-3, 0.0, 0.0, 0.0), 1e-5, 1, 1, 0
    )
    clock = VirtualClock()
    runner = SimulatedRunner(CalibratedCostModel(profile), clock, num_blocks=64, vocab_size=100)
    engine = Engine(runner, EngineConfig(), vocab_size=100, clock=clock)
    from kvpilot.engine.sampling import SamplingParams

    out = engine.generate([[1] * 40], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and all(0 < t < 100 for t in out.token_ids)
    # one 40-token prefill step, then 4 decode steps
    assert clock.now() == pytest.approx((1e-3 + 40e-4) + 4 * (1e-3 + 1e-3))
    assert runner.steps == 5 and runner.busy_s == pytest.approx(clock.now())


def test_replay_keeps_the_traces_gaps_and_pauses_for_them() -> None:
    shared = tuple(range(1, 200))
    sessions = [
        ReplaySession(
            "a",
            (
                ReplayCall(shared, 10, 0.0),
                ReplayCall((*shared, *range(300, 340)), 10, 0.001),
                ReplayCall((*shared, *range(300, 340), 7, 8), 10, 50.0),
            ),
        )
    ]
    engine, _ = build_engine(setup(), 32000)
    sim = Simulator(engine, duration_s=1000.0)
    driver = ReplayDriver(sessions, time_scale=1.0)
    sim.run(driver)
    assert driver.completed == 1 and driver.calls == 3
    arrivals = list(sim.turns.arrival_s)
    finishes = list(sim.turns.finish_s)
    # Each recorded gap is a tool wait after the call ends, announced as a pause.
    assert arrivals[1] == pytest.approx(finishes[0] + 0.001)
    assert arrivals[2] == pytest.approx(finishes[1] + 49.999)
    assert driver.pauses == 2 and sum(engine.offload.stats.decisions.values()) == 2
    # Each call restarts the session on its whole prompt (the trace's reply is not what
    # the simulator generated): the cache serves the common full blocks.
    assert driver.restarts == 2
    assert list(sim.turns.cached_tokens) == [0, 192, 224]
    assert list(sim.turns.prompt_tokens) == [199, 239, 241]


def test_replay_call_extending_the_session_is_its_next_turn() -> None:
    from kvpilot.engine.sampling import SamplingParams

    first = tuple(range(1, 100))
    probe, _ = build_engine(setup(), 32000)  # the same seeds: learn what the model will say
    said = probe.open_session().generate(first, SamplingParams(max_tokens=5, ignore_eos=True))
    extended = (*first, *said.token_ids, 500, 501, 502)
    engine, _ = build_engine(setup(), 32000)
    sim = Simulator(engine, duration_s=100.0)
    replay = ReplaySession("a", (ReplayCall(first, 5, 0.0), ReplayCall(extended, 3, 0.0)))
    driver = ReplayDriver([replay], time_scale=0.0)
    sim.run(driver)
    assert driver.restarts == 0 and driver.pauses == 0  # time_scale 0: back to back
    assert list(sim.turns.prompt_tokens) == [99, 107]
    # A next turn reuses the session's whole history, partial block included (99 prompt
    # tokens + 4 of the 5 generated ones were computed); a restart would reuse 96.
    assert list(sim.turns.cached_tokens) == [0, 103]


def test_policies_resolve_and_apply() -> None:
    config = EngineConfig()
    cfg, note = apply_policy(resolve_policy("no-prefix-cache"), config)
    assert cfg.scheduler.enable_prefix_caching is False and note is None
    cfg, _ = apply_policy(resolve_policy("tau-0.75"), config)
    assert cfg.scheduler.tau_high == 0.75
    cfg, note = apply_policy(resolve_policy("retain"), config)
    assert cfg.pause.policy == "retain" and note is None
    for bad in ("tau-2", "tau-x", "fastest"):
        with pytest.raises(ConfigError):
            resolve_policy(bad)


def test_prefix_caching_off_loses_the_shared_prefix() -> None:
    on = run_simulation(setup(), workload(arrival={"concurrent": 8, "ramp_s": 0}))
    off = run_simulation(
        setup(), workload(arrival={"concurrent": 8, "ramp_s": 0}), policy="no-prefix-cache"
    )
    assert off.hit_rate < on.hit_rate
    assert off.prefill_tokens > on.prefill_tokens


def test_lower_admission_ceiling_holds_less_kv() -> None:
    wl = workload(
        arrival={"concurrent": 40, "ramp_s": 0},
        trajectory={"turns": 4, "task_tokens": 400, "observation_tokens": 300, "output_tokens": 30},
        tools={"tests": {"weight": 1, "wait": 20}},
    )
    low = run_simulation(setup(kv_blocks=1200, duration_s=200.0), wl, policy="tau-0.5")
    high = run_simulation(setup(kv_blocks=1200, duration_s=200.0), wl, policy="tau-0.95")
    assert low.summary()["kv_held_mean"] < high.summary()["kv_held_mean"]


def overloaded(hints: str = "median") -> WorkloadConfig:
    return workload(
        arrival={"concurrent": 12, "ramp_s": 0},
        trajectory={"turns": 4, "task_tokens": 500, "observation_tokens": 50, "output_tokens": 10},
        shared_prefix={"system_tokens": 0, "tool_tokens": 0},
        tools={"bash": {"weight": 1, "wait": 1.0}},
        pause_hints=hints,
    )


def test_breakeven_pauses_keep_an_overloaded_engine_serving() -> None:
    # 12 sessions of ~32 blocks each in a 400-block pool: they cannot all stay resident.
    result = run_simulation(
        setup(kv_blocks=400, duration_s=120.0), overloaded(), policy="breakeven"
    )
    assert not result.stalled
    assert result.blocked_s == 0.0
    assert result.counters["trajectories_completed"] >= 12
    assert sum(result.extra["pause_decisions"].values()) > 0


@pytest.mark.parametrize(("policy", "hints"), [("retain", "median"), ("default", "none")])
def test_an_overloaded_engine_keeps_serving_without_pauses(policy: str, hints: str) -> None:
    result = run_simulation(
        setup(kv_blocks=400, duration_s=120.0), overloaded(hints), policy=policy
    )
    assert not result.stalled
    assert result.counters["trajectories_completed"] >= 12


def test_offload_policy_moves_paused_sessions_to_host_and_back() -> None:
    wl = workload(
        arrival={"concurrent": 6, "ramp_s": 0},
        tools={"tests": {"weight": 1, "wait": 20.0}},
        pause_hints="exact",
    )
    result = run_simulation(setup(duration_s=200.0), wl, policy="offload-host")
    moved = result.extra["bytes_moved_by_direction"]
    assert result.extra["pause_decisions"].get("offload_host", 0) > 0
    assert moved["device_to_host"] > 0 and moved["host_to_device"] > 0
    assert result.bytes_moved == sum(moved.values())
    assert result.extra["host_blocks"] > 0


def test_without_a_host_tier_nothing_moves() -> None:
    wl = workload(tools={"tests": {"weight": 1, "wait": 20.0}})
    result = run_simulation(
        setup(duration_s=100.0, host_kv_bytes_per_device=0), wl, policy="offload-host"
    )
    assert result.bytes_moved == 0 and result.extra["host_blocks"] == 0


def test_each_request_gets_sampling_params_of_its_own_length() -> None:
    """`submit` reuses one frozen `SamplingParams` per output length: each request still
    asks for its own length (at least one token) and ignores EOS."""
    s = setup(kv_blocks=300, duration_s=10.0)
    engine, _ = build_engine(s, 32000)
    sim = Simulator(engine, duration_s=s.duration_s)
    lengths = (5, 7, 5, 0, 7)
    rids = [sim.submit([1, 2, 3], n, lambda _out: None) for n in lengths]
    params = [engine.requests[rid].params for rid in rids if rid is not None]
    assert params == [SamplingParams(max(1, n), ignore_eos=True) for n in lengths]


def test_samples_take_the_gauges_a_snapshot_shows() -> None:
    """The simulator samples `Engine.load_gauges` (cheaper than a snapshot): every sample
    row holds the snapshot's own figures at that moment."""
    s = setup(kv_blocks=300, duration_s=40.0)
    wl = workload(arrival={"concurrent": 12, "ramp_s": 2})
    engine, _ = build_engine(s, wl.vocab_size)
    sim = Simulator(engine, duration_s=s.duration_s, sample_interval_s=0.5)
    rows = sim.samples
    seen: list[tuple[float, int, int]] = []

    def check(_now: float) -> None:  # called right after each sample is taken
        snap = engine.snapshot()
        assert (rows.kv_usage[-1], rows.kv_held[-1]) == (snap.kv_usage, snap.kv_held)
        assert (rows.running[-1], rows.waiting[-1]) == (snap.running, snap.waiting)
        assert rows.resident[-1] == snap.resident_trajectories
        seen.append((snap.kv_usage, snap.running, snap.resident_trajectories))

    sim.on_progress = check
    sim.run(AgentDriver(wl, engine.max_model_len))
    assert len(seen) >= 70 and any(r for _, r, _ in seen) and any(u > 0.1 for u, _, _ in seen)


def test_inter_token_latencies_are_kept_as_float32_of_the_engine_figures() -> None:
    """Each sample moves the engine's ITLs to the simulator's float32 log: the same values,
    rounded as ``array("f")`` rounds them, in the same order."""
    s = setup(kv_blocks=300, duration_s=30.0)
    wl = workload(arrival={"concurrent": 10, "ramp_s": 2})
    engine, _ = build_engine(s, wl.vocab_size)
    sim = Simulator(engine, duration_s=s.duration_s, sample_interval_s=0.5)
    seen: list[float] = []
    sample = sim._sample

    def recording_sample(now: float) -> None:
        seen.extend(engine.stats.itl_s)
        sample(now)

    sim._sample = recording_sample  # type: ignore[method-assign]
    sim.run(AgentDriver(wl, engine.max_model_len))
    assert len(seen) > 1000 and len(set(seen)) > 10
    assert sim.itl_s.tobytes() == array("f", seen).tobytes()
