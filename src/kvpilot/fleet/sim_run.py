"""Assemble and run fleet simulations: N simulated engines of one `SimSetup`, one router."""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.engine.engine import Engine
from kvpilot.fleet.scoring import RouterConfig
from kvpilot.fleet.sim import FleetSimulator
from kvpilot.fleet.sim_drivers import FleetAgentDriver, FleetReplayDriver
from kvpilot.fleet.sim_report import FleetResult
from kvpilot.sim.build import SimSetup, build_engine
from kvpilot.sim.replay import ReplaySession
from kvpilot.sim.workload import WorkloadConfig


def run_fleet(
    setup: SimSetup,
    workload: WorkloadConfig | Sequence[ReplaySession],
    *,
    replicas: int,
    router: str = "kvpilot",
    config: RouterConfig | None = None,
    event_delay_s: float = 0.05,
    families: int = 8,
    family_skew: float = 0.0,
    policy: str = "default",
    time_scale: float = 1.0,
    vocab_size: int | None = None,
    seed: int = 0,
) -> FleetResult:
    """Simulate ``workload`` on ``replicas`` engines of ``setup`` behind ``router``."""
    agents = isinstance(workload, WorkloadConfig)
    vocab = workload.vocab_size if isinstance(workload, WorkloadConfig) else vocab_size or 32000

    def make_engine() -> Engine:
        return build_engine(setup, vocab, policy)[0]

    fleet = FleetSimulator(
        make_engine,
        replicas,
        router,
        duration_s=setup.duration_s,
        config=config,
        event_delay_s=event_delay_s,
        seed=seed,
    )
    if agents and isinstance(workload, WorkloadConfig):
        probe = make_engine()
        driver: FleetAgentDriver | FleetReplayDriver = FleetAgentDriver(
            workload, families, family_skew, probe.max_model_len
        )
    else:
        assert not isinstance(workload, WorkloadConfig)
        driver = FleetReplayDriver(list(workload), time_scale)
    fleet.run(driver)
    return FleetResult.collect(fleet, driver.counters())
