"""The offload manager's inline count of the device blocks an idle session alone holds
(`held_blocks`, sampled every second for idle memory-time) agrees with the definition: its
private blocks plus the device copies of the exclusive part of its radix path."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.engine import Engine
from kvpilot.engine.pause_pricing import held_blocks
from kvpilot.memory import Tier, Trajectory
from kvpilot.sim.build import SimSetup, build_engine
from kvpilot.sim.drivers import AgentDriver
from kvpilot.sim.simulator import Simulator
from kvpilot.sim.workload import WorkloadConfig


def by_definition(engine: Engine, traj: Trajectory) -> int:
    nodes = engine.kv.residency.exclusive_nodes(traj)
    shared = sum(len(n.blocks[Tier.DEVICE]) for n in nodes if Tier.DEVICE in n.blocks)
    return shared + traj.num_private_blocks


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    forks=st.sampled_from([0.0, 0.5]),
    policy=st.sampled_from(["breakeven", "retain"]),  # policies that keep idle KV
)
def test_held_blocks_match_the_exclusive_path_definition(
    seed: int, forks: float, policy: str
) -> None:
    wl = WorkloadConfig.from_dict(
        {
            "seed": seed,
            "arrival": {"concurrent": 12, "ramp_s": 2},
            "trajectory": {
                "turns": {"dist": "uniform", "low": 2, "high": 5},
                "task_tokens": {"dist": "lognormal", "median": 150, "sigma": 0.8, "max": 900},
                "observation_tokens": {"dist": "lognormal", "median": 60, "sigma": 1.0},
                "output_tokens": {"dist": "lognormal", "median": 40, "sigma": 0.8, "max": 300},
                "max_context_tokens": 3000,
            },
            "shared_prefix": {"system_tokens": 100, "tool_tokens": 37},
            "tools": {"t": {"weight": 1, "wait": {"dist": "lognormal", "median": 2, "sigma": 1}}},
            "pause_hints": "median",
            "branching": {"probability": forks, "fork_factor": 2, "branch_turns": 2},
        }
    )
    setup = SimSetup(
        model="llama-3-8b",
        node="h100",
        kv_blocks=600,
        duration_s=30.0,
        engine=EngineConfig.from_kwargs(max_num_seqs=64, max_prefill_chunk=256),
    )
    engine, _ = build_engine(setup, wl.vocab_size, policy)
    checked = 0

    def check(_now: float) -> None:
        nonlocal checked
        for session in engine.sessions.idle():
            assert held_blocks(session.traj) == by_definition(engine, session.traj)
            checked += 1

    sim = Simulator(engine, duration_s=setup.duration_s, sample_interval_s=0.5, on_progress=check)
    sim.run(AgentDriver(wl, engine.max_model_len))
    assert checked > 0
