"""A fleet of simulated engines on virtual time, routed by the fleet's own router code.

Each replica is a normal simulated `Engine` (`kvpilot.sim.build.build_engine`) with its
own `VirtualClock`. The loop is a conservative co-simulation: it always advances whichever
is earliest, the busy replica with the smallest clock (one engine step) or the next fleet
event (an arrival, a KV event batch reaching the directory, a fault), so no replica ever
sees an event from its future. An idle replica's clock jumps to the time work reaches it.

Routing runs the same `Router` objects as the Ray Serve ingress. KV events and load reports
leave a replica after each of its steps and reach the router ``event_delay_s`` later,
as they would over a network; the router adds what it routed meanwhile itself.

Faults: ``kill(name)`` drops a replica (its directory entries go, the requests it had not
finished are routed again, its sessions continue elsewhere from their tokens);
``restart(name)`` brings it back empty, under a new epoch (the directory resyncs).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpilot.engine.engine import Engine
from kvpilot.engine.request import RequestOutput
from kvpilot.engine.sampling import SamplingParams
from kvpilot.errors import ConfigError, InvalidRequest, NoReplicaAvailable
from kvpilot.fleet.directory import PrefixDirectory
from kvpilot.fleet.events import EventBatch
from kvpilot.fleet.ideal import IdealCache
from kvpilot.fleet.keys import KeySpace
from kvpilot.fleet.kvpilot_router import KvpilotRouter
from kvpilot.fleet.load import FleetView, ReplicaLoad, RouteRequest
from kvpilot.fleet.replica import ReplicaAgent
from kvpilot.fleet.routers import Router, make_router
from kvpilot.fleet.scoring import RouterConfig
from kvpilot.fleet.sim_records import FleetLog, FleetSession, OnDone, Pending

EngineFactory = Callable[[], Engine]


@dataclass(slots=True)
class _Replica:
    name: str
    engine: Engine
    agent: ReplicaAgent | None
    alive: bool = True
    blocked: bool = False
    shipped_seq: int = 0


class FleetSimulator:
    def __init__(
        self,
        make_engine: EngineFactory,
        num_replicas: int,
        router: str = "kvpilot",
        *,
        duration_s: float,
        config: RouterConfig | None = None,
        event_delay_s: float = 0.05,
        seed: int = 0,
    ) -> None:
        if num_replicas < 1:
            raise ConfigError(f"a fleet needs at least one replica, got {num_replicas}")
        if duration_s <= 0:
            raise ConfigError(f"duration must be positive, got {duration_s}")
        if event_delay_s < 0:
            raise ConfigError("the event delay must not be negative")
        self.make_engine = make_engine
        self.duration_s = duration_s
        self.event_delay_s = event_delay_s
        names = [f"r{i}" for i in range(num_replicas)]
        self.fleet = FleetView(names)
        self.directory: PrefixDirectory | None = None
        if router == "kvpilot":
            probe = make_engine()  # the engines' own key space (block size, fingerprint)
            space = KeySpace.of_radix(probe.kv.radix)
            probe.close()
            self.directory = PrefixDirectory(space.key_space_id)
            self.router: Router = make_router(
                router,
                self.fleet,
                directory=self.directory,
                config=config,
                key_space=space,
                seed=seed,
            )
        else:
            self.router = make_router(router, self.fleet, seed=seed)
        self.router_name = router
        self.replicas: dict[str, _Replica] = {}
        for name in names:
            self._start_replica(name)
        self.log = FleetLog()
        self.ideal = IdealCache()
        self.rejected = 0
        self.retried = 0
        self.resyncs = 0
        self.wall_s = 0.0
        self.blocked_s = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._pending: dict[tuple[str, str], Pending] = {}
        self._now = 0.0
        self._dead_tokens: dict[str, int] = {}

    # -- replicas -----------------------------------------------------------------------

    def _start_replica(self, name: str) -> None:
        engine = self.make_engine()
        agent = ReplicaAgent(engine, name) if self.directory is not None else None
        if self.directory is not None:
            assert agent is not None
            self.directory.add_replica(name)
            self.directory.load_snapshot(name, agent.snapshot())
        self.replicas[name] = _Replica(name, engine, agent)
        self.fleet.add(name)

    def kill(self, name: str) -> None:
        """The replica dies now: everything it had not finished is routed again."""
        rep = self.replicas[name]
        if not rep.alive:
            return
        rep.alive = False
        self.fleet[name].live = False
        self.router.on_replica_removed(name)
        stats = rep.engine.stats
        self._dead_tokens[name] = (
            self._dead_tokens.get(name, 0) + stats.prefill_tokens + stats.decode_tokens
        )
        lost = [(key, p) for key, p in self._pending.items() if key[0] == name]
        for key, p in lost:
            del self._pending[key]
            self.router.on_finished(p.request, name)
            if p.fsession is not None:
                p.fsession.engine_session = None
                p.fsession.replica = None
            self.retried += 1
            self._route_and_submit(p, p.request.tokens)

    def restart(self, name: str) -> None:
        """Bring a killed replica back, empty (a new epoch: the directory resyncs)."""
        if self.replicas[name].alive:
            return
        self._start_replica(name)
        self.replicas[name].engine.clock.advance_to(self._now)  # type: ignore[attr-defined]

    # -- what drivers use ---------------------------------------------------------------

    @property
    def now(self) -> float:
        return self._now

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def after(self, delay_s: float, fn: Callable[[], None]) -> None:
        self.at(self._now + max(0.0, delay_s), fn)

    def open_session(self, salt: str | None = None) -> FleetSession:
        return FleetSession(f"fs-{next(self._ids)}", salt)

    def close_session(self, fsession: FleetSession) -> None:
        fsession.closed = True
        self._close_engine_session(fsession)
        if isinstance(self.router, KvpilotRouter):
            self.router.forget(RouteRequest("", (), fsession.salt, fsession.session_id))

    def submit(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        on_done: OnDone,
        *,
        session: FleetSession | None = None,
        affinity: str | None = None,
        pause: tuple[float | None, str | None] | None = None,
    ) -> bool:
        """Route and send a request: ``prompt`` is the whole prompt (a session turn's history
        plus its new tokens). ``affinity`` groups session-less requests (a replayed
        session, a prompt_cache_key). False when every replica rejects it."""
        rid = f"fr-{next(self._ids)}"
        salt = session.salt if session is not None else None
        request = RouteRequest(
            rid,
            prompt,
            salt,
            session.session_id if session is not None else None,
            None if session is not None else affinity,
        )
        ideal = self.ideal.lookup(request.tokens, salt, request.affinity)
        pending = Pending("", request, session, max_tokens, pause, on_done, self._now, ideal)
        return self._route_and_submit(pending, prompt)

    # -- routing and submission -----------------------------------------------------------

    def _route_and_submit(self, p: Pending, prompt: Sequence[int]) -> bool:
        try:
            decision = self.router.route(p.request, self._now)
        except NoReplicaAvailable:
            self.rejected += 1
            return False
        rep = self.replicas[decision.replica]
        engine = rep.engine
        clock = engine.clock
        if clock.now() < self._now:
            clock.advance_to(self._now)  # type: ignore[attr-defined]
        rep.blocked = False
        params = SamplingParams(max_tokens=max(1, p.max_tokens), ignore_eos=True)
        fs = p.fsession
        try:
            if fs is not None:
                session = fs.engine_session
                if (
                    fs.replica != rep.name
                    or session is None
                    or engine.sessions.get(session.session_id) is not session  # a new engine
                ):
                    self._close_engine_session(fs)
                    session = fs.engine_session = engine.open_session(salt=fs.salt)
                    fs.replica = rep.name
                new = list(prompt[session.num_tokens :])
                if list(prompt[: session.num_tokens]) != session.tokens:
                    raise ConfigError("a fleet session's prompt must extend its history")
                hint = p.pause
                if hint is not None:
                    rid = session.submit(new, params, expected_tool_wait_s=hint[0], tool=hint[1])
                else:
                    rid = session.submit(new, params)
            else:
                rid = engine.add_request(list(prompt), params, salt=p.request.salt)
        except InvalidRequest:
            self.rejected += 1
            return False
        p.replica = rep.name
        p.decision = decision
        self.router.on_routed(p.request, decision, self._now)
        self._pending[(rep.name, rid)] = p
        return True

    def _close_engine_session(self, fs: FleetSession) -> None:
        session = fs.engine_session
        if session is not None and fs.replica is not None and self.replicas[fs.replica].alive:
            session.close()
        fs.engine_session = None

    # -- the loop -----------------------------------------------------------------------

    def run(self, driver: FleetDriver) -> None:
        events = self._events
        end = self.duration_s
        replicas = self.replicas
        wall0 = time.perf_counter()
        driver.start(self)
        while True:  # hot path
            t_event = events[0][0] if events else math.inf
            chosen: _Replica | None = None
            t_chosen = math.inf
            for rep in replicas.values():
                if not rep.alive or rep.blocked:
                    continue
                engine = rep.engine
                if engine.has_unfinished() or engine.offload.busy():
                    t = engine.clock.now()
                else:
                    timer = engine.offload.next_event_at()
                    if timer is None:
                        continue
                    t = max(engine.clock.now(), timer)
                if t < t_chosen:
                    chosen, t_chosen = rep, t
            if chosen is not None and t_chosen <= t_event and t_chosen < end:
                self._step(chosen, t_chosen)
                continue
            if t_event >= end:
                break
            t, _, fn = heapq.heappop(events)
            self._now = t
            for rep in replicas.values():
                rep.blocked = False
            fn()
        self._now = end
        self.wall_s = time.perf_counter() - wall0

    def _step(self, rep: _Replica, t: float) -> None:
        engine = rep.engine
        clock = engine.clock
        if clock.now() < t:
            clock.advance_to(t)  # type: ignore[attr-defined]
        before = (engine.stats.steps, clock.now())
        outputs = engine.step(snapshots=False)
        self._now = max(self._now, clock.now())
        if not outputs and (engine.stats.steps, clock.now()) == before:
            rep.blocked = True  # admission holds everything back until something changes
            return
        if rep.agent is not None:
            self._ship(rep)
        for out in outputs:
            if out.finished:
                self._complete(rep, out)

    def _ship(self, rep: _Replica) -> None:
        agent = rep.agent
        assert agent is not None
        load = agent.load()
        batch: EventBatch | None = None
        resync = False
        if agent.log.seq > rep.shipped_seq:
            batch = agent.events_since(rep.shipped_seq, agent.epoch)
            resync = batch is None  # the log overflowed since the last step
            rep.shipped_seq = agent.log.seq
        t = rep.engine.clock.now() + self.event_delay_s
        self.at(t, lambda: self._deliver(rep, agent, batch, resync, load))

    def _deliver(
        self,
        rep: _Replica,
        agent: ReplicaAgent,
        batch: EventBatch | None,
        resync: bool,
        load: ReplicaLoad,
    ) -> None:
        if rep.agent is not agent or not rep.alive:
            return  # from a replica that has died since
        directory = self.directory
        assert directory is not None
        if resync or (batch is not None and not directory.apply(rep.name, batch)):
            self.resyncs += 1
            directory.load_snapshot(rep.name, agent.snapshot())
        self.fleet[rep.name].on_report(load)

    def _complete(self, rep: _Replica, out: RequestOutput) -> None:
        rep.engine.pop_output(out.request_id)
        p = self._pending.pop((rep.name, out.request_id), None)
        if p is None:
            return
        self.router.on_finished(p.request, rep.name)
        log = self.log
        log.replica.append(rep.name)
        log.arrival_s.append(p.arrival_s)
        first = out.first_token_time
        log.ttft_s.append(math.nan if first is None else first - p.arrival_s)
        log.prompt_tokens.append(out.prompt_tokens)
        log.cached_tokens.append(out.cached_tokens)
        log.ideal_tokens.append(p.ideal_tokens)
        assert p.decision is not None
        log.predicted_tokens.append(p.decision.matched_tokens)
        context = list(p.request.tokens) + list(out.token_ids)
        self.ideal.add(context, p.request.salt, p.request.affinity)
        p.on_done(out)

    # -- results ------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Requests routed and not finished (at the end: cut off by the duration)."""
        return len(self._pending)

    def computed_tokens(self) -> dict[str, int]:
        """Tokens each replica computed (prefill, recomputation included, and decode)."""
        out = {}
        for name, rep in self.replicas.items():
            stats = rep.engine.stats
            done = 0 if not rep.alive else stats.prefill_tokens + stats.decode_tokens
            out[name] = done + self._dead_tokens.get(name, 0)
        return out


class FleetDriver:
    """A workload: schedules events on the fleet and reacts to finished requests."""

    def start(self, fleet: FleetSimulator) -> None:
        raise NotImplementedError

    def counters(self) -> dict[str, int]:
        return {}
