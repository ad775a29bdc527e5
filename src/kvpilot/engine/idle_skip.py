"""Idle steps skipped on virtual time: nothing to run but simulated copies in flight.

When the engine has nothing to schedule and only tier copies are in flight, each step idles
for `IDLE_STEP_S` and polls again. Once such a step changed nothing (an idle step found the
engine in the same state as the idle step just before it: a fixed point of the step), every
step after it changes nothing either until something happens. On a virtual clock whose
copies know when they complete (`TimedTransfer`: the simulator's link and disk),
`IdleSkipper.skip` then moves the clock over those steps at once: to the last point of the
same grid (``now + IDLE_STEP_S``, ``+ IDLE_STEP_S``, ..., the same float additions the
steps would make) strictly before the earliest of

- a copy's completion (``finish_s``),
- the offload manager's next due poll (a pause timer, an idle memory-time sample),
- ``until``: the caller's next event (a simulation's workload event, sample or end).

The step at the next grid point then runs as usual, so the engine notices every completion
and timer at the same clock time, bit for bit, as stepping one idle step at a time; only the
no-op steps in between are skipped. It skips nothing (and the step idles as before) on the
first idle step after a change (a step may start a load that makes the next one reclaim
memory), while a request is held back by admission (its hold ends with time, not with an
event), while a copy does not say when it finishes (a real copy, on a thread or an
accelerator stream), or while a load waits to start its next stage (the next poll does).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from kvpilot.engine.clock import WallClock
from kvpilot.engine.executor import Transfer
from kvpilot.memory.tiers import DEVICE

if TYPE_CHECKING:
    from kvpilot.engine.clock import Clock
    from kvpilot.engine.offload import OffloadManager
    from kvpilot.engine.scheduler import Scheduler
    from kvpilot.engine.stats import EngineStats
    from kvpilot.memory import KVManager

# The idle step's length: how long the engine waits before polling its copies again.
IDLE_STEP_S = 0.0005
# Grid points this close to a wake-up are left to stepping (a comparison there may round
# either way: the simulator tests ``t - t0 >= event``, the skip ``t >= t0 + event``).
WAKE_MARGIN_S = 1e-9
# At most this many idle steps are skipped at once (the grid is walked by additions).
MAX_SKIPPED_STEPS = 1 << 20
# With nothing to run but copies in flight: the most real time a virtual clock gives copies
# that run on threads before it moves on (the idle step itself: `IDLE_STEP_S`).
REAL_COPY_WAIT_S = 0.05


class TimedTransfer(Transfer, Protocol):
    """A copy on a virtual clock that knows its completion time (`SimulatedTransfer`,
    `SimulatedIO`): done once the clock reaches ``finish_s``."""

    finish_s: float


def next_completion(transfers: Iterable[Transfer]) -> float | None:
    """The earliest completion time of ``transfers`` (inf: none), or None when one of them
    does not say when it finishes."""
    earliest = math.inf
    for transfer in transfers:
        finish = getattr(transfer, "finish_s", None)
        if not isinstance(finish, float):
            return None
        earliest = min(earliest, finish)
    return earliest


class IdleEngine(Protocol):
    """What idle skipping reads of `kvpilot.engine.core.EngineCore` (a protocol, so that this
    module need not import the engine that imports it)."""

    scheduler: Scheduler
    offload: OffloadManager
    kv: KVManager
    clock: Clock
    stats: EngineStats


def wake_at(engine: IdleEngine, until: float) -> float | None:
    """The clock time of the first thing an idle engine must react to, or None when it
    cannot be known (see the module docstring)."""
    if engine.scheduler.held_back:
        return None
    mover = engine.offload.mover
    transfers = mover.in_flight()
    loads = len(mover.loader.loads) if mover.loader is not None else 0
    if len(transfers) != len(mover.moves) + loads:
        return None  # a load between stages: its next transfer starts at the next poll
    finish = next_completion(transfers)
    if finish is None:
        return None
    return min(finish, engine.offload.next_poll_at(), until)


def idle_state(engine: IdleEngine) -> tuple[object, ...]:
    """What an idle step could change: the queues, the pool, the copies, pauses, counters."""
    sched, offload = engine.scheduler, engine.offload
    return (
        len(sched.waiting),
        len(sched.running),
        sched.num_preemptions,
        sched.num_deferred_admissions,
        engine.kv.device.num_free,
        engine.kv.radix.evictable_blocks(DEVICE),
        tuple(map(id, offload.mover.in_flight())),
        len(offload.records),
        offload.next_event_at(),
        sum(offload.stats.decisions.values()),
        engine.stats.steps,
    )


class IdleSkipper:
    """Skips an engine's idle steps on virtual time (see the module docstring)."""

    def __init__(self, engine: IdleEngine) -> None:
        self.engine = engine
        # The clock time the next idle step starts at if nothing else moves the clock, and
        # the state this one left.
        self._last: tuple[float, tuple[object, ...]] | None = None

    def idle_step(self, idle_until: float | None) -> None:
        """Nothing to run but copies in flight or held-back hot state: give them a moment.

        On any clock but the wall clock, copies that run on threads (real disk and host
        copies) are first given real time to finish, so that a virtual clock cannot race
        past the pause's timers while real work is still in flight. Copies on virtual time
        that say when they finish let the clock skip the idle steps before the first
        completion, timer or ``idle_until`` (`skip`)."""
        engine = self.engine
        clock, offload = engine.clock, engine.offload
        if isinstance(clock, WallClock):
            if not offload.wait_for_copies(IDLE_STEP_S):
                clock.sleep(IDLE_STEP_S)
        else:
            threads = offload.wait_for_copies(REAL_COPY_WAIT_S)
            if threads or idle_until is None or not self.skip(idle_until):
                clock.sleep(IDLE_STEP_S)

    def skip(self, until: float) -> int:
        """Advance the clock over the idle steps before `wake_at` (at least one step, as the
        idle step would); returns the steps advanced, 0 when none could be (the caller
        idles one step)."""
        engine = self.engine
        clock = engine.clock
        advance_to = getattr(clock, "advance_to", None)
        now = clock.now()
        state = idle_state(engine)
        last, self._last = self._last, (now + IDLE_STEP_S, state)
        if advance_to is None or last != (now, state):
            return 0  # the first idle step after a change, or after a step that ran
        target = wake_at(engine, until)
        if target is None:
            return 0
        limit = target - WAKE_MARGIN_S
        t = now + IDLE_STEP_S
        steps = 1
        while steps < MAX_SKIPPED_STEPS:
            nxt = t + IDLE_STEP_S
            if nxt >= limit:
                break
            t = nxt
            steps += 1
        advance_to(t)
        self._last = (t, state)  # every step skipped left the state as it was
        return steps
