"""Fleet workloads: agent families on the fleet simulator, and trace replay.

`FleetAgentDriver` runs the trajectories of a `WorkloadConfig` as fleet sessions, like the
single-engine `kvpilot.sim.drivers.AgentDriver`, with one difference that matters for
routing: trajectories belong to ``families`` of agents, each with its own shared system
and tool prompt (the workload's ``system_tokens + tool_tokens``, drawn per family), picked
with Zipf weights of exponent ``family_skew`` (0: uniform). Each turn sends the session's
whole context (history + new tokens) to the router, which may move the session. A fork's
branches are sessions of their own, starting from the parent's context.

`FleetReplayDriver` replays recorded sessions: each call is a whole prompt, grouped by its
session for affinity (as a client passing ``prompt_cache_key`` would).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass
from functools import partial

from kvpilot.engine.request import RequestOutput
from kvpilot.errors import ConfigError
from kvpilot.fleet.sim import FleetDriver, FleetSession, FleetSimulator
from kvpilot.sim.arrivals import Arrivals, pause_hint
from kvpilot.sim.replay import ReplaySession
from kvpilot.sim.trajectories import TrajectoryIds, TrajectorySpec, TurnSpec, WorkloadGenerator
from kvpilot.sim.workload import WorkloadConfig


@dataclass(eq=False, slots=True)
class _Actor:
    uid: int
    family: int
    ids: TrajectoryIds  # the trajectory's content ids, its branches' included
    turns: tuple[TurnSpec, ...]
    session: FleetSession
    context: list[int]
    parent: _Actor | None = None
    turn: int = 0
    branches_left: int = 0


class FleetAgentDriver(FleetDriver):
    def __init__(
        self,
        config: WorkloadConfig,
        families: int = 8,
        family_skew: float = 0.0,
        max_model_len: int = 1 << 30,
    ) -> None:
        if families < 1:
            raise ConfigError(f"a fleet workload needs at least one agent family, got {families}")
        if config.layout != "stable":
            raise ConfigError("the fleet simulator runs stable prompt layouts only")
        self.config = config
        self.max_model_len = max_model_len
        self.generators = [
            WorkloadGenerator(dataclasses.replace(config, seed=config.seed * 1000 + f))
            for f in range(families)
        ]
        self.trajectories = WorkloadGenerator(config)
        weights = [1.0 / (f + 1) ** family_skew for f in range(families)]
        self._family_weights = weights
        self._rng = random.Random(f"{config.seed}:families")
        self._tool_median = {t.name: t.wait_s.median() for t in config.tools}
        self._uids = itertools.count()
        self._next_index = 0
        self.arrivals = Arrivals(config, self._begin)
        self.started = 0
        self.completed = 0
        self.truncated = 0
        self.calls = 0
        self._fleet: FleetSimulator | None = None

    def counters(self) -> dict[str, int]:
        return {
            "trajectories_started": self.started,
            "trajectories_completed": self.completed,
            "trajectories_truncated": self.truncated,
            "calls": self.calls,
            "arrivals_waiting": self.arrivals.backlog,
        }

    @property
    def fleet(self) -> FleetSimulator:
        assert self._fleet is not None, "start() the driver first"
        return self._fleet

    def start(self, fleet: FleetSimulator) -> None:
        self._fleet = fleet
        self.arrivals.start(fleet)

    def _begin(self) -> None:
        index = self._next_index
        self._next_index += 1
        spec: TrajectorySpec = self.trajectories.trajectory(index)
        family = self._rng.choices(range(len(self.generators)), self._family_weights)[0]
        gen = self.generators[family]
        ids = self.trajectories.trajectory_ids(spec)
        actor = _Actor(next(self._uids), family, ids, spec.turns, self.fleet.open_session(), [])
        self.started += 1
        self._send(actor, gen.shared_ids + ids.turn(spec.turns[0]).tolist())

    def _send(self, actor: _Actor, prompt: list[int]) -> None:
        turn = actor.turns[actor.turn]
        self.calls += 1
        ok = self.fleet.submit(
            prompt,
            turn.output_tokens,
            lambda out: self._done(actor, out),
            session=actor.session,
            pause=self._pause_hint(actor),
        )
        if not ok:
            self.truncated += 1
            self._end(actor)

    def _pause_hint(self, actor: _Actor) -> tuple[float | None, str | None] | None:
        return pause_hint(self.config.pause_hints, actor.turns, actor.turn, self._tool_median)

    def _done(self, actor: _Actor, out: RequestOutput) -> None:
        actor.context = actor.session.tokens
        fork = actor.turns[actor.turn].fork
        if fork is not None:
            actor.branches_left = len(fork.branches)
            for turns in fork.branches:
                child = _Actor(
                    next(self._uids),
                    actor.family,
                    actor.ids,
                    turns,
                    self.fleet.open_session(),
                    list(actor.context),
                    parent=actor,
                )
                child.turn = -1
                self._advance(child)
            return
        self._advance(actor)

    def _advance(self, actor: _Actor) -> None:
        actor.turn += 1
        if actor.turn >= len(actor.turns):
            self._end(actor)
            return
        turn = actor.turns[actor.turn]
        if len(actor.context) + turn.new_tokens + turn.output_tokens >= self.max_model_len:
            self.truncated += 1
            self._end(actor)
            return
        self.fleet.after(turn.wait_before_s, lambda: self._next_call(actor))

    def _next_call(self, actor: _Actor) -> None:
        new = actor.ids.turn(actor.turns[actor.turn]).tolist()
        self._send(actor, actor.context + new)

    def _end(self, actor: _Actor) -> None:
        self.fleet.close_session(actor.session)
        parent = actor.parent
        if parent is not None:
            parent.branches_left -= 1
            if parent.branches_left == 0:
                self._advance(parent)
            return
        self.completed += 1
        self.arrivals.ended()


class FleetReplayDriver(FleetDriver):
    """Call i+1 of a session at its recorded offset x ``time_scale``, after call i ends."""

    def __init__(self, sessions: list[ReplaySession], time_scale: float = 1.0) -> None:
        if time_scale < 0:
            raise ConfigError("time_scale must not be negative")
        self.sessions = sessions
        self.time_scale = time_scale
        self.started = 0
        self.completed = 0
        self.calls = 0
        self.rejected = 0
        self._fleet: FleetSimulator | None = None

    def counters(self) -> dict[str, int]:
        return {
            "trajectories_started": self.started,
            "trajectories_completed": self.completed,
            "calls": self.calls,
            "calls_rejected": self.rejected,
        }

    def start(self, fleet: FleetSimulator) -> None:
        self._fleet = fleet
        for session in self.sessions:
            t = session.calls[0].offset_s * self.time_scale
            fleet.at(t, partial(self._begin, session))

    def _begin(self, session: ReplaySession) -> None:
        self.started += 1
        self._send(session, 0)

    def _send(self, session: ReplaySession, i: int) -> None:
        fleet = self._fleet
        assert fleet is not None
        call = session.calls[i]
        self.calls += 1
        ok = fleet.submit(
            call.prompt,
            call.output_tokens,
            lambda _out: self._done(session, i),
            affinity=session.session_id,
        )
        if not ok:
            self.rejected += 1
            self._done(session, i)

    def _done(self, session: ReplaySession, i: int) -> None:
        fleet = self._fleet
        assert fleet is not None
        if i + 1 >= len(session.calls):
            self.completed += 1
            return
        t = max(fleet.now, session.calls[i + 1].offset_s * self.time_scale)
        fleet.at(t, lambda: self._send(session, i + 1))
