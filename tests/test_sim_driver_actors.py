"""The agent driver's actors: their callbacks are bound once, and an ended one is freed by
reference counting (the simulation leaves no cycles for the garbage collector)."""

from __future__ import annotations

import gc

from test_sim_simulator import setup, workload

from kvpilot.sim.build import build_engine
from kvpilot.sim.drivers import AgentDriver, _Actor
from kvpilot.sim.simulator import Simulator


def test_ended_actors_leave_no_cyclic_garbage() -> None:
    wl = workload(
        arrival={"concurrent": 3, "ramp_s": 0},
        branching={"probability": 1, "fork_factor": 2, "max_depth": 1, "branch_turns": 1},
    )
    engine, _ = build_engine(setup(duration_s=200.0), wl.vocab_size)
    sim = Simulator(engine, duration_s=200.0)
    driver = AgentDriver(wl, engine.max_model_len)
    gc.collect()
    gc.disable()  # no collection may free an ended actor's cycle before we look
    try:
        sim.run(driver)
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable, kept to look at
        gc.collect()
        ended = [o for o in gc.garbage if isinstance(o, _Actor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert driver.completed >= 3 and driver.forks >= 3  # trajectories and branches ended
    assert ended == []
