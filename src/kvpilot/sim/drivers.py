"""Workload drivers: agent trajectories as engine sessions, and trace replay.

`AgentDriver` runs each trajectory of a `WorkloadConfig` as an engine session: the first
turn submits ``system + tools + task``; when a turn finishes, the next one arrives after its
tool wait and appends its observation (``session.submit``). A turn followed by a tool call
announces it (``expected_tool_wait_s``, ``tool``, per the workload's ``pause_hints``), so the
engine's pause policy decides what happens to the session's KV during the wait. A fork
calls ``session.fork(n)``; the branches run their turns while the parent waits, then the
parent resumes. With an
unstable layout each call re-sends the whole context with a fresh volatile token in a new
session (the old one closes; its blocks stay in the prefix cache), so the cache can reuse
only what precedes the volatile token.

`ReplayDriver` replays recorded sessions as engine sessions, the trace's gaps as tool waits
(see `ReplayDriver` and `kvpilot.sim.replay`).
"""

from __future__ import annotations

import functools
import itertools
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpilot.engine.request import RequestOutput
from kvpilot.engine.session import Session
from kvpilot.sim.arrivals import Arrivals, pause_hint
from kvpilot.sim.replay import ReplaySession
from kvpilot.sim.simulator import Simulator
from kvpilot.sim.trajectories import TrajectoryIds, TrajectorySpec, TurnSpec, WorkloadGenerator
from kvpilot.sim.workload import WorkloadConfig


@dataclass(eq=False, slots=True)
class _Actor:
    """A trajectory, or one branch of a fork, as it runs."""

    uid: int
    spec: TrajectorySpec
    ids: TrajectoryIds  # the trajectory's content ids, its branches' included
    turns: tuple[TurnSpec, ...]
    session: Session
    parent: _Actor | None = None
    turn: int = 0
    calls: int = 0
    branches_left: int = 0
    # The driver's callbacks bound to this actor once (`AgentDriver._actor`), not per turn:
    done: Callable[[RequestOutput], None] = field(init=False)  # its turn finished
    next_call: Callable[[], None] = field(init=False)  # its tool wait is over


# Trajectories an `AgentDriver` draws and hashes at a time: hashing ids in batches of 8 costs
# a quarter less than one by one; more gains little and draws more that are never begun.
PREPARED = 8


class AgentDriver:
    def __init__(self, config: WorkloadConfig, max_model_len: int = 1 << 30) -> None:
        self.config = config
        self.generator = WorkloadGenerator(config)
        self.max_model_len = max_model_len
        self.started = 0
        self.completed = 0
        self.truncated = 0
        self.forks = 0
        self.calls = 0
        self.arrivals = Arrivals(config, self._begin)
        self._next_index = 0  # the next trajectory to draw (`_prepare`)
        self._ready: deque[tuple[TrajectorySpec, TrajectoryIds]] = deque()  # drawn, not begun
        self._uids = itertools.count()
        self._unstable = config.layout == "unstable"
        self._volatile_at = self.generator.volatile_position()
        self._tool_median = {t.name: t.wait_s.median() for t in config.tools}
        self._sim: Simulator | None = None

    def counters(self) -> dict[str, int]:
        return {
            "trajectories_started": self.started,
            "trajectories_completed": self.completed,
            "trajectories_truncated": self.truncated,
            "forks": self.forks,
            "calls": self.calls,
            "arrivals_waiting": self.arrivals.backlog,
        }

    @property
    def sim(self) -> Simulator:
        assert self._sim is not None, "start() the driver first"
        return self._sim

    def start(self, sim: Simulator) -> None:
        self._sim = sim
        # What each turn calls on the simulator, bound once (not through `sim` per turn).
        self._submit = sim.submit
        self._after = sim.after
        self.arrivals.start(sim)

    def _begin(self) -> None:
        if not self._ready:
            self._prepare()
        spec, ids = self._ready.popleft()
        session = self.sim.engine.open_session()
        actor = self._actor(spec, ids, spec.turns, session, None)
        self.started += 1
        prompt = self.generator.first_prompt_ids(spec, ids)
        if self._unstable:
            prompt.insert(self._volatile_at, self._volatile(actor))
        self._send(actor, prompt)

    def _prepare(self) -> None:
        """Draw the next `PREPARED` trajectories and hash their ids together (a trajectory
        is a pure function of its index, so drawing it early changes nothing; at most
        ``PREPARED - 1`` are drawn and never begun)."""
        first = self._next_index
        self._next_index += PREPARED
        specs = [self.generator.trajectory(i) for i in range(first, first + PREPARED)]
        self._ready.extend(zip(specs, self.generator.trajectory_ids_many(specs), strict=True))

    def _actor(
        self,
        spec: TrajectorySpec,
        ids: TrajectoryIds,
        turns: tuple[TurnSpec, ...],
        session: Session,
        parent: _Actor | None,
    ) -> _Actor:
        actor = _Actor(next(self._uids), spec, ids, turns, session, parent)
        # Partials call on without a frame of their own; made once per actor, not per turn.
        actor.done = functools.partial(self._done, actor)
        actor.next_call = functools.partial(self._next_call, actor)
        return actor

    def _volatile(self, actor: _Actor) -> int:
        return self.generator.volatile_token(actor.uid, actor.calls)

    def _send(self, actor: _Actor, prompt: list[int] | array) -> None:
        turn = actor.turns[actor.turn]
        actor.calls += 1
        self.calls += 1
        rid = self._submit(
            prompt,
            turn.output_tokens,
            actor.done,
            session=actor.session,
            pause=pause_hint(self.config.pause_hints, actor.turns, actor.turn, self._tool_median),
        )
        if rid is None:
            self.truncated += 1
            self._end(actor)

    def _next_call(self, actor: _Actor) -> None:
        turn = actor.turns[actor.turn]
        new = actor.ids.turn(turn)
        if not self._unstable:
            self._send(actor, new)
            return
        context = actor.session.tokens
        v = self._volatile_at
        context[v] = self._volatile(actor)
        actor.session.close()
        actor.session = self.sim.engine.open_session()
        self._send(actor, context + new.tolist())

    def _done(self, actor: _Actor, out: RequestOutput) -> None:
        fork = actor.turns[actor.turn].fork
        if fork is not None and not actor.session.closed:
            children = actor.session.fork(len(fork.branches))
            self.forks += 1
            actor.branches_left = len(children)
            for child_session, turns in zip(children, fork.branches, strict=True):
                child = self._actor(actor.spec, actor.ids, turns, child_session, actor)
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
        if actor.session.num_tokens + turn.new_tokens + turn.output_tokens >= self.max_model_len:
            self.truncated += 1
            self._end(actor)
            return
        self._after(turn.wait_before_s, actor.next_call)

    def _end(self, actor: _Actor) -> None:
        actor.session.close()
        # Nothing calls the actor back any more: dropping its callbacks breaks the cycles
        # they make with it, so that reference counting frees it (the run makes no garbage
        # for the cyclic collector, `kvpilot.sim.collector`).
        del actor.done, actor.next_call
        parent = actor.parent
        if parent is not None:
            parent.branches_left -= 1
            if parent.branches_left == 0:
                self._advance(parent)
            return
        self.completed += 1
        self.arrivals.ended()


class ReplayDriver:
    """Replays recorded sessions, each as an engine session, the trace's gaps as tool waits.

    A session starts at its first call's offset x ``time_scale``. When call i finishes, the
    session pauses for the recorded gap to call i+1, ``(offset[i+1] - offset[i]) x
    time_scale``, announcing that wait (tool ``trace``), so the engine's pause policy decides
    whether its KV is retained, offloaded or dropped meanwhile; then call i+1 is sent. A
    recorded gap also holds the recorded model's generation time, so these waits are an
    upper bound on the tool time. ``time_scale=0`` sends calls back to back, with no pauses.

    A call whose prompt extends the session's tokens is the session's next turn; any other
    (the usual case: the prompt holds the recorded reply, not the simulated one) restarts the
    session on the whole prompt, as ``kvpilot serve`` does for a diverging history: the radix
    cache serves the shared prefix from whatever tier holds it.
    """

    def __init__(self, sessions: list[ReplaySession], time_scale: float = 1.0) -> None:
        if time_scale < 0:
            raise ValueError("time_scale must not be negative")
        self.sessions = sessions
        self.time_scale = time_scale
        self.started = 0
        self.completed = 0
        self.calls = 0
        self.rejected = 0
        self.restarts = 0
        self.pauses = 0
        self._sim: Simulator | None = None

    def counters(self) -> dict[str, int]:
        return {
            "trajectories_started": self.started,
            "trajectories_completed": self.completed,
            "calls": self.calls,
            "calls_rejected": self.rejected,
            "session_restarts": self.restarts,
            "tool_pauses": self.pauses,
            "empty_calls_skipped": sum(s.empty_calls for s in self.sessions),
        }

    @property
    def sim(self) -> Simulator:
        assert self._sim is not None, "start() the driver first"
        return self._sim

    def start(self, sim: Simulator) -> None:
        self._sim = sim
        for session in self.sessions:
            t = session.calls[0].offset_s * self.time_scale
            sim.at(t, functools.partial(self._begin, session))

    def _begin(self, replay: ReplaySession) -> None:
        self.started += 1
        self._send(replay, self.sim.engine.open_session(), 0)

    def _send(self, replay: ReplaySession, session: Session, i: int) -> None:
        sim = self.sim
        call = replay.calls[i]
        self.calls += 1
        history = session.tokens  # a list: a slice of the prompt compares equal to it
        prompt: tuple[int, ...] | list[int] = call.prompt
        if history:
            if len(prompt) > len(history) and list(prompt[: len(history)]) == history:
                prompt = prompt[len(history) :]
            else:
                self.restarts += 1
                session.close()
                session = sim.engine.open_session()
        rid = sim.submit(
            prompt, call.output_tokens, lambda _out: self._done(replay, session, i), session=session
        )
        if rid is None:
            self.rejected += 1
            self._done(replay, session, i)

    def _done(self, replay: ReplaySession, session: Session, i: int) -> None:
        sim = self.sim
        if i + 1 >= len(replay.calls):
            self.completed += 1
            session.close()
            return
        wait = (replay.calls[i + 1].offset_s - replay.calls[i].offset_s) * self.time_scale
        if wait > 0 and session.active_request is None and not session.closed:
            session.pause(wait, "trace")
            self.pauses += 1
        sim.after(wait, lambda: self._send(replay, session, i + 1))
