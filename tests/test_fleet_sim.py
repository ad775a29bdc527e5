"""The fleet simulator: the same router code on virtual time, faults, and resyncs."""

from __future__ import annotations

import pytest

from kvpilot.errors import ConfigError
from kvpilot.fleet.sim import FleetSimulator
from kvpilot.fleet.sim_drivers import FleetAgentDriver, FleetReplayDriver
from kvpilot.fleet.sim_report import FleetResult
from kvpilot.memory import Tier
from kvpilot.sim.build import SimSetup, build_engine
from kvpilot.sim.replay import ReplayCall, ReplaySession
from kvpilot.sim.trajectories import TurnSpec
from kvpilot.sim.workload import WorkloadConfig

SETUP = SimSetup(model="llama-3-8b", node="1xh100", kv_blocks=3000, duration_s=40.0)
WORKLOAD = WorkloadConfig.from_yaml_text(
    """
seed: 5
arrival: {concurrent: 24, ramp_s: 5}
trajectory:
  turns: {dist: uniform, low: 3, high: 8}
  task_tokens: {dist: fixed, value: 300}
  observation_tokens: {dist: lognormal, median: 300, sigma: 0.5, max: 1500}
  output_tokens: {dist: fixed, value: 24}
  max_context_tokens: 8000
shared_prefix: {system_tokens: 1200, tool_tokens: 400}
tools:
  bash: {weight: 1, wait: {dist: lognormal, median: 1, sigma: 0.5}}
branching: {probability: 0.2, fork_factor: 2, max_depth: 1, branch_turns: 2}
"""
)


def fleet(router: str, replicas: int = 3, **kw: object) -> FleetSimulator:
    return FleetSimulator(
        lambda: build_engine(SETUP, WORKLOAD.vocab_size)[0],
        replicas,
        router,
        duration_s=SETUP.duration_s,
        **kw,  # type: ignore[arg-type]
    )


def run(sim: FleetSimulator, families: int = 4) -> tuple[FleetResult, FleetAgentDriver]:
    driver = FleetAgentDriver(WORKLOAD, families=families)
    sim.run(driver)
    return FleetResult.collect(sim, driver.counters()), driver


def assert_directory_matches_replicas(sim: FleetSimulator) -> None:
    """After delivering what is still in flight, the directory holds exactly each live
    replica's blocks (by tier)."""
    directory = sim.directory
    assert directory is not None
    for name, rep in sim.replicas.items():
        if not rep.alive:
            assert name not in directory.replicas
            continue
        assert rep.agent is not None
        epoch, seq = directory.sync_state(name)
        batch = rep.agent.events_since(seq, epoch)
        if batch is None or not directory.apply(name, batch):
            directory.load_snapshot(name, rep.agent.snapshot())
        snapshot = rep.agent.snapshot()
        for tier in Tier:
            assert directory.num_blocks(name, tier) == snapshot.num_blocks(tier), (name, tier)
        rep.engine.check_invariants()
    directory.check_invariants()


def test_kvpilot_routes_near_the_ideal_and_beats_round_robin() -> None:
    kv, _ = run(fleet("kvpilot"))
    rr, _ = run(fleet("round_robin"))
    assert kv.requests > 100 and rr.requests > 100
    assert kv.hit_rate >= 0.95 * kv.ideal_hit_rate
    assert kv.hit_rate <= kv.ideal_hit_rate + 0.02
    assert kv.hit_rate > rr.hit_rate + 0.05


def test_agent_prompts_are_the_family_prefix_then_history_then_turn_content() -> None:
    """The driver takes each turn's ids from `trajectory_ids` (one hash per trajectory):
    they must be `content` of the turn's seed, after the family's prefix or the history."""
    driver = FleetAgentDriver(WORKLOAD, families=3)
    sent: list[tuple[int, TurnSpec, list[int], list[int]]] = []
    send = driver._send

    def record(actor, prompt):  # type: ignore[no-untyped-def]
        sent.append((actor.family, actor.turns[actor.turn], list(actor.context), prompt))
        send(actor, prompt)

    driver._send = record  # type: ignore[method-assign]
    fleet("kvpilot").run(driver)
    assert len(sent) > 50
    content = driver.trajectories.content
    forks = 0
    for family, turn, context, prompt in sent:
        head = context or driver.generators[family].shared_ids
        forks += turn.fork is not None
        assert prompt == head + content(turn.content_seed, turn.new_tokens)
    assert forks > 0


def test_directory_follows_the_replicas_through_delayed_events() -> None:
    sim = fleet("kvpilot", event_delay_s=0.2)
    result, _ = run(sim)
    assert result.resyncs == 0
    assert_directory_matches_replicas(sim)


def test_an_overflowing_event_log_resyncs_from_a_snapshot() -> None:
    sim = fleet("kvpilot", replicas=2)
    for rep in sim.replicas.values():
        assert rep.agent is not None
        rep.agent.log._events = type(rep.agent.log._events)(maxlen=1)
        rep.agent.log.capacity = 1
    result, _ = run(sim)
    assert result.resyncs > 0
    assert result.hit_rate >= 0.9 * result.ideal_hit_rate
    assert_directory_matches_replicas(sim)


def test_a_killed_replica_loses_nothing_and_its_sessions_move() -> None:
    sim = fleet("kvpilot")
    routed_after: list[str] = []
    original = sim.router.route

    def watch(request, now):  # type: ignore[no-untyped-def]
        decision = original(request, now)
        if now > 15.0:
            routed_after.append(decision.replica)
        return decision

    sim.router.route = watch  # type: ignore[method-assign]
    sim.at(15.0, lambda: sim.kill("r1"))
    result, driver = run(sim)
    assert sim.retried > 0
    assert driver.truncated == 0 and result.rejected == 0
    assert driver.calls == result.requests + sim.in_flight  # every call finished or runs
    assert routed_after and "r1" not in routed_after
    assert result.router_counters["rehomed"] > 0
    assert_directory_matches_replicas(sim)
    assert result.hit_rate >= 0.8 * result.ideal_hit_rate


def test_restarted_replica_rejoins_empty_under_a_new_epoch() -> None:
    sim = fleet("kvpilot", replicas=2)
    sim.at(10.0, lambda: sim.kill("r0"))
    sim.at(12.0, lambda: sim.restart("r0"))
    result, _ = run(sim)
    assert sim.replicas["r0"].alive
    assert sim.replicas["r0"].engine.stats.requests_finished > 0
    assert_directory_matches_replicas(sim)
    assert result.requests > 50


def test_replay_groups_a_session_by_affinity() -> None:
    calls = []
    prompt: list[int] = list(range(1, 900))
    for i in range(6):
        calls.append(ReplayCall(tuple(prompt), 16, i * 0.5))
        prompt = prompt + list(range(5000 + 100 * i, 5064 + 100 * i))
    sessions = [
        ReplaySession(
            f"s{j}",
            tuple(ReplayCall(tuple(x + 7 * j for x in c.prompt), 16, c.offset_s) for c in calls),
        )
        for j in range(4)
    ]
    for router in ("kvpilot", "session_hash"):
        sim = fleet(router)
        driver = FleetReplayDriver(sessions)
        sim.run(driver)
        result = FleetResult.collect(sim, driver.counters())
        assert result.requests == 24
        assert result.hit_rate >= 0.95 * result.ideal_hit_rate, router


def test_fleet_options_are_checked() -> None:
    with pytest.raises(ConfigError):
        fleet("kvpilot", replicas=0)
    with pytest.raises(ConfigError, match="unknown router"):
        fleet("fastest")
    with pytest.raises(ConfigError, match="family"):
        FleetAgentDriver(WORKLOAD, families=0)


def test_sim_cli_compares_routers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    import typer
    from typer.testing import CliRunner

    from kvpilot.cli.sim import sim

    app = typer.Typer()
    app.command()(sim)
    app.command("other")(lambda: None)  # keeps typer in multi-command mode
    workload = tmp_path / "w.yaml"
    workload.write_text(
        "arrival: {concurrent: 8, ramp_s: 2}\n"
        "trajectory: {turns: 3, task_tokens: 300, output_tokens: 16}\n"
        "shared_prefix: {system_tokens: 512, tool_tokens: 0}\n"
        "tools: {bash: {weight: 1, wait: 1}}\n"
    )
    args = ["sim", "--model", "llama-3-8b", "--node", "h100", "--kv-blocks", "2000",
            "--workload", str(workload), "--duration", "15s", "--replicas", "2",
            "--compare-routers", "--routers", "round_robin", "--families", "2",
            "--out", str(tmp_path / "out"), "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r["router"] for r in rows] == ["kvpilot", "round_robin"]
    for row in rows:
        assert row["replicas"] == 2 and row["requests"] > 0
        assert 0 < row["hit_rate"] <= row["ideal_hit_rate"] + 0.02
    assert (tmp_path / "out" / "routers.png").read_bytes().startswith(b"\x89PNG")
