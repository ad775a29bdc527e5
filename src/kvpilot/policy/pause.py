"""Pause policies: what to do with a paused trajectory's KV state, behind one interface.

- ``breakeven`` (default): the spec's rule (`decide_pause`) on measured inputs.
- ``retain``: keep the state resident until the agent returns (a lease).
- ``drop``: free it now, recompute on return.
- ``offload-host`` / ``offload-disk``: always move it to that tier.
- ``ttl``: keep it resident for a fixed time, then let it go (the Continuum-style baseline).
- ``lru``: no pause awareness: unlock it and let the prefix cache's LRU eviction decide,
  which is what current engines do.
- ``oracle``, ``infercept``, ``continuum``, ``infercept-oracle``: the rule on the true wait,
  two published baselines (`kvpilot.policy.baselines`) on their own wait estimates, and
  InferCept on the true wait. ``oracle`` and ``infercept-oracle`` expect the true wait as the
  caller's hint (``TRUE_WAIT_POLICIES``): replays that know it give it to them, and to no
  other; they are bounds, not rivals.

A policy sees the same measured `PauseInputs` as the rule and returns a `PauseDecision`, so
every decision, whoever made it, carries its figures and a sentence saying why.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, Protocol

from kvpilot.errors import ConfigError
from kvpilot.policy.baselines import Continuum, InferCept, Oracle
from kvpilot.policy.breakeven import (
    ENGINE_THRESHOLDS,
    PauseAction,
    PauseDecision,
    PauseInputs,
    PauseThresholds,
    decide_pause,
)
from kvpilot.units import format_bytes, format_seconds


class PausePolicy(Protocol):
    """What the engine asks of a pause policy (a frozen dataclass satisfies ``name``)."""

    @property
    def name(self) -> str: ...

    @property
    def reads_tool_waits(self) -> bool:
        """Whether `decide` or `lease_s` read `PauseInputs.tool_waits` (the engine copies a
        tool's recent waits into every pause's inputs only for a policy that does)."""
        ...

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
    """The rule, with the engine's thresholds (`ENGINE_THRESHOLDS`) unless told others."""

    name: str = "breakeven"
    thresholds: PauseThresholds = ENGINE_THRESHOLDS
    reads_tool_waits: ClassVar[bool] = False

    def decide(self, inputs: PauseInputs) -> PauseDecision:
        return decide_pause(inputs, self.thresholds)

    def lease_s(self, inputs: PauseInputs) -> float:
        return math.inf


@dataclass(frozen=True, slots=True)
class Always:
    """Always the same action (retain / drop / offload-host / offload-disk / lru)."""

    name: str
    action: PauseAction
    reads_tool_waits: ClassVar[bool] = False

    def decide(self, inputs: PauseInputs) -> PauseDecision:
        size = format_bytes(inputs.kv_bytes)
        what = {
            PauseAction.RETAIN: f"{size} stays on the device until the agent returns",
            PauseAction.DROP: f"{size} is freed now and recomputed on return",
            PauseAction.OFFLOAD_HOST: f"{size} moves to host memory until the agent returns",
            PauseAction.OFFLOAD_DISK: f"{size} moves to disk until the agent returns",
            PauseAction.CACHE: f"{size} is unlocked and the prefix cache's LRU decides its fate",
        }[self.action]
        reason = f"{self.action.label}, as this policy always does: {what}."
        return _fixed(inputs, self.action, reason)

    def lease_s(self, inputs: PauseInputs) -> float:
        return math.inf


@dataclass(frozen=True, slots=True)
class TimeToLive:
    """Retain for ``ttl_s`` seconds, then release to the prefix cache."""

    ttl_s: float = 10.0
    name: str = "ttl"
    reads_tool_waits: ClassVar[bool] = False

    def decide(self, inputs: PauseInputs) -> PauseDecision:
        size, lease = format_bytes(inputs.kv_bytes), format_seconds(self.ttl_s)
        return _fixed(
            inputs,
            PauseAction.RETAIN,
            f"Retain for {lease} (the ttl policy's lease): {size} stays on the device that "
            "long, then goes to the prefix cache.",
        )

    def lease_s(self, inputs: PauseInputs) -> float:
        return self.ttl_s


POLICY_NAMES = (
    "breakeven",
    "retain",
    "drop",
    "offload-host",
    "offload-disk",
    "ttl",
    "lru",
    "infercept",
    "continuum",
    "oracle",
    "infercept-oracle",
)
# Policies that decide on the true wait: a replay that knows it passes it as the hint.
TRUE_WAIT_POLICIES = frozenset({"oracle", "infercept-oracle"})
# One line each, for people choosing a policy (`kvpilot serve`'s banner, `kvpilot top`).
POLICY_SUMMARIES = {
    "breakeven": "retain, offload or drop each pause by the break-even rule on measured figures",
    "retain": "keep every paused session's KV on the device until it returns",
    "drop": "free every paused session's KV and recompute it on return",
    "offload-host": "move every paused session's KV to host memory",
    "offload-disk": "move every paused session's KV to disk",
    "ttl": "keep paused KV on the device for a fixed lease, then let the cache evict it",
    "lru": "no pause awareness: the prefix cache's LRU eviction decides (today's engines)",
    "infercept": "InferCept: the way out that wastes least memory-time, on each tool's mean wait",
    "continuum": "Continuum: pin for a time-to-live fitted to each tool's observed waits",
    "oracle": "the break-even rule on the true wait (a bound for any wait predictor)",
    "infercept-oracle": "InferCept on the true wait (a bound, like oracle)",
}


def make_pause_policy(name: str, *, ttl_s: float = 10.0) -> PausePolicy:
    """The policy called ``name``; ``ttl_s`` is ttl's lease and continuum's default one."""
    if name == "breakeven":
        return BreakEven()
    if name == "ttl":
        return TimeToLive(ttl_s)
    if name == "oracle":
        return Oracle()
    if name == "infercept":
        return InferCept()
    if name == "infercept-oracle":
        return InferCept("infercept-oracle", true_wait=True)
    if name == "continuum":
        return Continuum(default_ttl_s=ttl_s)
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
