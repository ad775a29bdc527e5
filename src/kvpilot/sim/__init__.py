"""The simulator: the engine's own scheduler and memory core on virtual time.

`run_simulation(SimSetup(...), workload)` builds a normal `kvpilot.engine.Engine` whose
executor is a `SimulatedRunner` (a roofline or calibrated cost model advancing a
`VirtualClock`) and drives it with an agent workload or a trace replay.
"""

from __future__ import annotations

from kvpilot.sim.batch_shape import BatchShape, batch_shape
from kvpilot.sim.build import SimSetup, build_engine, kv_pool_blocks, run_simulation
from kvpilot.sim.cost_model import RooflineCostModel, StepCostModel
from kvpilot.sim.drivers import AgentDriver, ReplayDriver
from kvpilot.sim.policies import POLICIES, SimPolicy, apply_policy, resolve_policy
from kvpilot.sim.profile import CalibratedCostModel, StepProfile
from kvpilot.sim.replay import ReplayCall, ReplayOptions, ReplaySession, load_replay
from kvpilot.sim.report import SimResult
from kvpilot.sim.runner import SimulatedRunner
from kvpilot.sim.simulator import Simulator
from kvpilot.sim.trajectories import WorkloadGenerator
from kvpilot.sim.transport import SimulatedTransport
from kvpilot.sim.workload import WorkloadConfig

__all__ = [
    "POLICIES",
    "AgentDriver",
    "BatchShape",
    "CalibratedCostModel",
    "ReplayCall",
    "ReplayDriver",
    "ReplayOptions",
    "ReplaySession",
    "RooflineCostModel",
    "SimPolicy",
    "SimResult",
    "SimSetup",
    "SimulatedRunner",
    "SimulatedTransport",
    "Simulator",
    "StepCostModel",
    "StepProfile",
    "WorkloadConfig",
    "WorkloadGenerator",
    "apply_policy",
    "batch_shape",
    "build_engine",
    "kv_pool_blocks",
    "load_replay",
    "resolve_policy",
    "run_simulation",
]
