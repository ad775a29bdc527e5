"""The event loop: drive an `Engine` with a workload, on whatever clock the engine has.

One loop for both executors. On a `VirtualClock` (the simulator) idle time is skipped by
advancing the clock to the next event; on a wall clock (calibration against the real
engine) it is slept. Every iteration:

1. fire the workload events that are due (turn arrivals after tool waits, forks, new
   trajectories); they submit requests to the engine;
2. run one engine step if the engine has work, tier copies in flight, or a pause timer due
   (prefetch, lease expiry); hand finished requests back to the workload. When every
   running sequence is decoding and nothing else is due, a whole run of such steps is
   advanced at once (`kvpilot.engine.decode_run`), up to the next event, or up to the step
   that finishes turns (handed back as a step's would be): the same result as stepping, for
   a fraction of the cost; samples due inside the run are taken there, at the boundaries
   where stepping would take them, from the same state (`plan_looks`, `look`), so they do
   not cut it. Likewise, when nothing runs but copies in flight, the idle steps before the
   next completion or sample (`kvpilot.engine.idle_skip`);
3. when nothing could run (idle, or every waiting request blocked by admission), move to the
   next workload event or engine timer; with neither left, stop;
4. sample telemetry every ``sample_interval_s``.

Time during which the engine holds unfinished work yet can schedule none of it (admission
refuses every waiting request and nothing runs) is counted in ``blocked_s``: a healthy
engine keeps it at zero.

It stops at ``duration_s`` (requests still in flight are not counted as finished turns).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from array import array
from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Protocol

from kvpilot.engine.decode_run import advance_decode_run
from kvpilot.engine.engine import Engine
from kvpilot.engine.request import RequestOutput
from kvpilot.engine.sampling import SamplingParams
from kvpilot.engine.session import Session
from kvpilot.errors import InvalidRequest
from kvpilot.sim.collector import fewer_collections
from kvpilot.sim.telemetry import Samples, Telemetry, TurnLog

OnDone = Callable[[RequestOutput], None]
_NAN = math.nan


class Driver(Protocol):
    """A workload: it schedules events on the simulator and reacts to finished requests."""

    def start(self, sim: Simulator) -> None: ...

    def counters(self) -> dict[str, int]: ...


class Simulator:
    """Runs a `Driver` against ``engine`` for ``duration_s`` of the engine clock's time."""

    def __init__(
        self,
        engine: Engine,
        *,
        duration_s: float,
        sample_interval_s: float = 1.0,
        on_progress: Callable[[float], None] | None = None,
        decode_runs: bool = True,
        idle_skips: bool = True,
    ) -> None:
        if duration_s <= 0:
            raise ValueError(f"duration must be positive, got {duration_s}")
        if sample_interval_s <= 0:
            raise ValueError(f"sample interval must be positive, got {sample_interval_s}")
        self.engine = engine
        self.clock = engine.clock
        self.duration_s = duration_s
        self.sample_interval_s = sample_interval_s
        self.on_progress = on_progress
        self.decode_runs = decode_runs  # False: step one by one (the reference behaviour)
        self.idle_skips = idle_skips  # False: idle one step at a time while copies run
        self.t0 = self.clock.now()
        self.turns = TurnLog()
        self.samples = Samples()
        self._telemetry = Telemetry(self.samples, self.turns)
        self.rejected = 0
        self.stalled = False
        self.blocked_s = 0.0
        self.wall_s = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._pending: dict[str, tuple[OnDone, float]] = {}  # by request: (on_done, arrival_s)
        self._params: dict[int, SamplingParams] = {}  # by max_tokens (`submit`)
        self._event_time: float | None = None
        self._next_sample = 0.0  # while a decode run takes samples (`plan_looks`, `look`)

    # -- what drivers use ----------------------------------------------------------------

    @property
    def now(self) -> float:
        """Seconds since the simulation started."""
        return self.clock.now() - self.t0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at simulation time ``t`` (or right away if that is past)."""
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def after(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` ``delay_s`` from now (a negative delay is none)."""
        delay_s = delay_s if delay_s > 0.0 else 0.0  # max(0.0, delay_s), NaN included
        heapq.heappush(self._events, (self.clock.now() - self.t0 + delay_s, next(self._seq), fn))

    def submit(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        on_done: OnDone,
        *,
        session: Session | None = None,
        arrival_s: float | None = None,
        pause: tuple[float | None, str | None] | None = None,
    ) -> str | None:
        """Send a request (a session's next turn when ``session`` is given).

        ``pause`` is the (expected tool wait, tool) the turn announces: the session pauses
        when it ends. Returns the request id, or None when the engine rejects it (e.g.
        longer than the KV pool);
        ``arrival_s`` is when it was meant to arrive, for TTFT (default: the time of the
        event being fired, which may be a step earlier than now).
        """
        max_tokens = max_tokens if max_tokens > 1 else 1  # max(1, max_tokens), cheaper
        params = self._params.get(max_tokens)
        if params is None:  # frozen, so one per length serves every request of that length
            params = self._params[max_tokens] = SamplingParams(max_tokens, ignore_eos=True)
        try:
            if session is not None and pause is not None:
                rid = session.submit(prompt, params, expected_tool_wait_s=pause[0], tool=pause[1])
            elif session is not None:
                rid = session.submit(prompt, params)
            else:
                rid = self.engine.add_request(prompt, params)
        except InvalidRequest:
            self.rejected += 1
            return None
        if arrival_s is None:  # `now`, inline
            t = self._event_time
            arrival_s = self.clock.now() - self.t0 if t is None else t
        self._pending[rid] = (on_done, arrival_s)
        return rid

    @property
    def itl_s(self) -> array:
        """Every inter-token latency so far (float32), in the engine's order (complete when
        `run` returns)."""
        return self._telemetry.itl_s

    # -- the loop ------------------------------------------------------------------------

    def run(self, driver: Driver) -> None:
        with fewer_collections():  # the garbage collector walks less, results are the same
            self._run(driver)

    def _run(self, driver: Driver) -> None:
        engine = self.engine
        offload = engine.offload
        clock_now, t0 = self.clock.now, self.t0
        has_work = engine.has_unfinished
        step = engine.step
        decode_runs, idle_skips = self.decode_runs, self.idle_skips
        end = self.duration_s
        events = self._events
        next_sample = 0.0
        finished: list[RequestOutput] = []  # what a decode run finishes (emptied after each)
        wall0 = time.perf_counter()
        driver.start(self)
        while True:  # hot path
            now = clock_now() - t0
            while events and events[0][0] <= now:
                t, _, fn = heapq.heappop(events)
                self._event_time = t
                fn()
                self._event_time = None
            if now >= end:
                break
            if now >= next_sample:
                self._sample(now)
                next_sample = now + self.sample_interval_s
                if self.on_progress is not None:
                    self.on_progress(now)
            run = has_work() or offload.busy()
            if not run:  # an idle engine still has its pause timers (prefetch, leases)
                timer = offload.next_event_at()
                run = timer is not None and timer - t0 <= now
            if run:
                # min(events[0][0], end) and below min(limit, next_sample) as comparisons: the
                # builtins parse their arguments as keywords (~1.8k instructions a call).
                limit = events[0][0] if events and events[0][0] < end else end
                if decode_runs:
                    # Samples fall inside runs: `plan_looks` and `look` take them there.
                    self._next_sample = next_sample
                    if advance_decode_run(engine, t0 + limit, finished=finished, lookout=self):
                        next_sample = self._next_sample
                        for out in finished:
                            self._complete(out)
                        finished.clear()
                        continue
                if next_sample < limit:
                    limit = next_sample
                steps = engine.stats.steps
                outputs = step(snapshots=False, idle_until=t0 + limit if idle_skips else None)
                for out in outputs:
                    if out.finished:
                        self._complete(out)
                if engine.stats.steps != steps or outputs or clock_now() - t0 != now:
                    continue
            timer = offload.next_event_at()
            # Nothing ran: idle, or every waiting request is held back by admission.
            blocked = has_work()
            wake = [events[0][0]] if events else []
            if timer is not None:
                wake.append(timer - t0)
            if not wake:
                self.stalled = blocked
                break
            target = min(*wake, end)
            if blocked:
                self.blocked_s += max(0.0, target - now)
            self._wait_until(target)
        self._sample(min(self.now, end))
        self._telemetry.flush()
        self.wall_s = time.perf_counter() - wall0

    # -- samples inside decode runs (`kvpilot.engine.run_protocols.RunLookout`) --------------

    def plan_looks(self, starts: Sequence[float]) -> tuple[list[int], int]:
        """The step boundaries of a decode run (clock times ``starts``) at which the loop
        would sample had the run stopped for each sample, and how many steps the run may
        take: it ends at a boundary where the loop has more to do (an event due, the end).

        The loop ends a run at the first boundary at or past ``t0 + next_sample`` and samples
        there if ``now >= next_sample`` (else it steps on to the next boundary); these are the
        same tests, on the same floats."""
        t0, interval, end = self.t0, self.sample_interval_s, self.duration_s
        events = self._events
        due = events[0][0] if events else math.inf
        k = len(starts) - 1
        next_sample = self._next_sample
        looks: list[int] = []
        j = bisect_left(starts, t0 + next_sample, 1, k)
        while j < k:
            now = starts[j] - t0
            if due <= now or now >= end:
                return looks, j
            if now >= next_sample:
                looks.append(j)
                next_sample = now + interval
                j = bisect_left(starts, t0 + next_sample, j + 1, k)
            else:
                j += 1
        return looks, k

    def look(self) -> None:
        """Sample at a boundary `plan_looks` chose (the engine shows the state there)."""
        now = self.clock.now() - self.t0
        self._sample(now)
        self._next_sample = now + self.sample_interval_s
        if self.on_progress is not None:
            self.on_progress(now)

    def _wait_until(self, t: float) -> None:
        before = self.clock.now()
        dt = t - (before - self.t0)
        if dt > 0:
            self.clock.sleep(dt)
        advance_to = getattr(self.clock, "advance_to", None)
        if advance_to is not None and self.clock.now() == before:
            # Rounding left a virtual clock where it was (t is a hair ahead, and adding the
            # difference rounds back; or ``t - t0`` and the engine's own test ``clock >= t``
            # disagree): move on by the least step, or the loop would spin here for ever.
            advance_to(math.nextafter(before, math.inf))

    def _complete(self, out: RequestOutput) -> None:
        rid = out.request_id
        pending = self._pending.pop(rid, None)
        self.engine.pop_output(rid)
        if pending is None:
            return
        on_done, arrival_s = pending
        log = self.turns
        t0 = self.t0
        log.arrival_s.append(arrival_s)
        first = out.first_token_time
        log.first_token_s.append(_NAN if first is None else first - t0)
        log.finish_s.append(self.clock.now() - t0)
        log.prompt_tokens.append(out.prompt_tokens)
        log.cached_tokens.append(out.cached_tokens)
        log.output_tokens.append(out.generated_tokens)
        on_done(out)

    def _sample(self, now: float) -> None:
        engine = self.engine
        s = self.samples
        gauges = engine.load_gauges()  # what a snapshot shows, at a fraction of its cost
        s.time_s.append(now)
        s.kv_usage.append(gauges.kv_usage)
        s.kv_held.append(gauges.kv_held)
        s.running.append(gauges.running)
        s.waiting.append(gauges.waiting)
        s.resident.append(gauges.resident_trajectories)
        # The engine keeps every ITL in a list: moved out here, its percentiles reduced in
        # batches with the TTFTs' (`Telemetry`).
        self._telemetry.take(engine.stats.itl_s)
