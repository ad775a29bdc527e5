"""Pause policies: what to do with a paused trajectory's KV state, behind one interface.

- ``breakeven`` (default): the spec's rule (`decide_pause`) on measured inputs.
- ``retain``: keep the state resident until the agent returns (a lease).
- ``drop``: free it now, recompute on return.
- ``offload-host`` / ``offload-disk``: always move it to that tier.
- ``ttl``: keep it resident for a fixed time, then let it go (the Continuum-style baseline).
- ``lru``: no pause awareness: unlock it and let the prefix cache's LRU eviction decide,
  which is what current engines do.

A policy sees the same measured `PauseInputs` as the rule and returns a `PauseDecision`, so
every decision, whoever made it, carries its figures and a sentence saying why.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol

from kvpilot.errors import ConfigError
from kvpilot.policy.breakeven import PauseAction, PauseDecision, PauseInputs, decide_pause


class PausePolicy(Protocol):
    name: str

    def decide(self, inputs: PauseInputs) -> PauseDecision:
        """The action for one paused trajectory."""
        ...

    def lease_s(self, inputs: PauseInputs) -> float:
        """How long a RETAIN decision holds the state before it is let go (inf: until used)."""
        ...


def _fixed(inputs: PauseInputs, action: PauseAction, reason: str) -> PauseDecision:
    """A decision that ignores the rule but still reports the rule's figures."""
    figures = decide_pause(inputs)
    return dataclasses.replace(figures, action=action, reason=reason)


@dataclass(frozen=True, slots=True)
class BreakEven:
    name: str = "breakeven"

    def decide(self, inputs: PauseInputs) -> PauseDecision:
        return decide_pause(inputs)

    def lease_s(self, inputs: PauseInputs) -> float:
        return math.inf


@dataclass(frozen=True, slots=True)
class Always:
    """Always the same action (retain / drop / offload-host / offload-disk / lru)."""

    name: str
    action: PauseAction

    def decide(self, inputs: PauseInputs) -> PauseDecision:
        what = {
            PauseAction.RETAIN: "keep the state resident until the agent returns",
            PauseAction.DROP: "free the state now and recompute it on return",
            PauseAction.OFFLOAD_HOST: "move the state to host memory",
            PauseAction.OFFLOAD_DISK: "move the state to disk",
            PauseAction.CACHE: "unlock the state and leave it to the prefix cache's LRU",
        }[self.action]
        return _fixed(inputs, self.action, f"policy {self.name}: {what}")

    def lease_s(self, inputs: PauseInputs) -> float:
        return math.inf


@dataclass(frozen=True, slots=True)
class TimeToLive:
    """Retain for ``ttl_s`` seconds, then release to the prefix cache."""

    ttl_s: float = 10.0
    name: str = "ttl"

    def decide(self, inputs: PauseInputs) -> PauseDecision:
        return _fixed(
            inputs,
            PauseAction.RETAIN,
            f"policy ttl: keep the state resident for {self.ttl_s:g} s, then release it",
        )

    def lease_s(self, inputs: PauseInputs) -> float:
        return self.ttl_s


POLICY_NAMES = ("breakeven", "retain", "drop", "offload-host", "offload-disk", "ttl", "lru")


def make_pause_policy(name: str, *, ttl_s: float = 10.0) -> PausePolicy:
    if name == "breakeven":
        return BreakEven()
    if name == "ttl":
        return TimeToLive(ttl_s)
    fixed = {
        "retain": PauseAction.RETAIN,
        "drop": PauseAction.DROP,
        "offload-host": PauseAction.OFFLOAD_HOST,
        "offload-disk": PauseAction.OFFLOAD_DISK,
        "lru": PauseAction.CACHE,
    }
    if name not in fixed:
        raise ConfigError(f"unknown pause policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return Always(name, fixed[name])
