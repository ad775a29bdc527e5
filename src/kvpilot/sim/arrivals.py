"""When agent trajectories start, and what a running turn announces about its tool call.

Shared by the single-engine `AgentDriver` and the fleet's `FleetAgentDriver`, so both read
a `WorkloadConfig` the same way:

- ``arrival.concurrent = N``: N trajectories open at once (the first N spread over
  ``ramp_s``); each one that ends is replaced at once.
- ``arrival.rate_per_s``: a Poisson process; with ``max_open`` set, arrivals beyond the cap
  wait in a backlog and start as open trajectories end.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Protocol

from kvpilot.sim.trajectories import TurnSpec
from kvpilot.sim.workload import ArrivalConfig, WorkloadConfig


class Timeline(Protocol):
    """Virtual time as the simulators expose it."""

    def at(self, t: float, fn: Callable[[], None]) -> None: ...

    def after(self, dt: float, fn: Callable[[], None]) -> None: ...


class Arrivals:
    """Starts trajectories (``begin()``) by the workload's arrival model."""

    def __init__(self, config: WorkloadConfig, begin: Callable[[], None]) -> None:
        self.config: ArrivalConfig = config.arrival
        self._begin = begin
        self._rng = random.Random(f"{config.seed}:arrivals")
        self._timeline: Timeline | None = None
        self.open = 0
        self.backlog = 0

    def start(self, timeline: Timeline) -> None:
        self._timeline = timeline
        if self.config.concurrent is not None:
            n = self.config.concurrent
            for i in range(n):
                timeline.at(self.config.ramp_s * i / n, self._launch)
        else:
            timeline.at(self._interarrival(), self._arrive)

    def ended(self) -> None:
        """A trajectory finished: its slot goes to the next one, or a waiting arrival."""
        self.open -= 1
        if self.config.concurrent is not None:
            self._launch()
        elif self.backlog:
            self.backlog -= 1
            self._launch()

    def _launch(self) -> None:
        self.open += 1
        self._begin()

    def _interarrival(self) -> float:
        rate = self.config.rate_per_s
        assert rate is not None
        return self._rng.expovariate(rate)

    def _arrive(self) -> None:
        assert self._timeline is not None
        self._timeline.after(self._interarrival(), self._arrive)
        cap = self.config.max_open
        if cap is not None and self.open >= cap:
            self.backlog += 1
        else:
            self._launch()


def pause_hint(
    mode: str, turns: tuple[TurnSpec, ...], i: int, tool_median: Mapping[str, float]
) -> tuple[float | None, str | None] | None:
    """What turn ``i`` says about the tool call after it (None: no pause follows).

    ``mode`` is the workload's ``pause_hints``: ``exact`` (the true wait), ``median`` (the
    tool's median wait), ``tool`` (the tool's name only) or ``none``.
    """
    if mode == "none" or turns[i].fork is not None or i + 1 >= len(turns):
        return None
    nxt = turns[i + 1]
    if mode == "exact":
        return nxt.wait_before_s, nxt.tool
    if mode == "median":
        return tool_median[nxt.tool], nxt.tool
    return None, nxt.tool
