"""Published pause policies to measure the break-even rule against, and its oracle bound.

- ``oracle``: the break-even rule on the pause's *true* wait. A replay that knows the future
  (`benchmarks/bench_pause.py`, the simulator's pause driver) gives it as the caller's hint;
  no predictor can do better with the rule, so it bounds what better wait prediction buys.
- ``infercept``: InferCept's min-waste choice (Abhyankar et al., ICML 2024). Each way out
  wastes memory-time (GB·s): retaining holds M for the wait T; dropping recomputes for
  ``recompute_s`` while every byte on the device waits for that prefill; swapping holds M
  while it goes out and comes back. It takes the least waste, whatever the pressure. Like
  the paper, it estimates T from the profiled durations of the same kind of interception:
  the mean of the tool's observed waits (the engine's own prediction before any is seen).
  ``infercept-oracle`` is the same choice on the pause's true wait: a bound, like ``oracle``.
- ``continuum``: Continuum's time-to-live pinning by tool (Li et al., 2025). A tool's recent
  waits give its wait distribution; the lease ``t`` maximises the expected recompute saved by
  a return within ``t`` minus the memory-time held until then. With no history it pins for
  ``default_ttl_s``. When the lease ends, the prefix cache's LRU decides.

Waste and benefit are in bytes x seconds, the same tax the break-even rule prices.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from kvpilot.policy.breakeven import (
    ENGINE_THRESHOLDS,
    PauseAction,
    PauseDecision,
    PauseInputs,
    PauseThresholds,
    decide_pause,
)
from kvpilot.units import format_bytes, format_seconds


@dataclass(frozen=True, slots=True)
class Oracle:
    """The break-even rule on the true wait (given as the hint by a replay that knows it)."""

    name: str = "oracle"
    thresholds: PauseThresholds = ENGINE_THRESHOLDS
    reads_tool_waits: ClassVar[bool] = False

    def decide(self, inputs: PauseInputs) -> PauseDecision:
        decision = decide_pause(inputs, self.thresholds)
        label = decision.action.label
        reason = f"{label} (oracle, on the true wait){decision.reason[len(label) :]}"
        return dataclasses.replace(decision, reason=reason)

    def lease_s(self, inputs: PauseInputs) -> float:
        return math.inf


def infercept_waste(inputs: PauseInputs) -> dict[PauseAction, float]:
    """Memory-time (byte·s) each feasible way out wastes, by InferCept's accounting."""
    m, wait = inputs.kv_bytes, inputs.expected_wait_s
    batch = max(inputs.device_used_bytes, m)
    decision = decide_pause(inputs)  # for the measured reload and recompute times
    waste = {
        PauseAction.RETAIN: m * wait,
        PauseAction.DROP: decision.recompute_s * batch,
    }
    if inputs.device_host_bw_bytes_s > 0 and inputs.host_free_bytes >= m:
        waste[PauseAction.OFFLOAD_HOST] = 2 * decision.reload_s * m
    elif math.isfinite(decision.disk_reload_s):
        waste[PauseAction.OFFLOAD_DISK] = 2 * decision.disk_reload_s * m
    return waste


def mean_tool_wait(inputs: PauseInputs) -> float:
    """InferCept's estimate of a pause's wait: the mean of the tool's observed waits, or the
    engine's prediction while none has been seen."""
    waits = [w for w in inputs.tool_waits if w >= 0 and math.isfinite(w)]
    return sum(waits) / len(waits) if waits else inputs.expected_wait_s


@dataclass(frozen=True, slots=True)
class InferCept:
    """InferCept's min-waste choice; ``true_wait``: on the caller's hint as the true wait
    (``infercept-oracle``), else on its own estimate (`mean_tool_wait`)."""

    name: str = "infercept"
    true_wait: bool = False
    reads_tool_waits: ClassVar[bool] = True

    def decide(self, inputs: PauseInputs) -> PauseDecision:
        if not self.true_wait:
            inputs = dataclasses.replace(inputs, expected_wait_s=mean_tool_wait(inputs))
        waste = infercept_waste(inputs)
        order = sorted(waste, key=lambda a: (waste[a], list(PauseAction).index(a)))
        action, runner_up = order[0], order[1]
        reason = (
            f"{action.label} {format_bytes(inputs.kv_bytes)} (InferCept: the least memory-time "
            f"wasted over the {'true' if self.true_wait else 'expected'} "
            f"{format_seconds(inputs.expected_wait_s)} wait, "
            f"{waste[action] / 1e9:.3g} GB·s against {waste[runner_up] / 1e9:.3g} GB·s for the "
            "next best way out)."
        )
        return dataclasses.replace(decide_pause(inputs), action=action, reason=reason)

    def lease_s(self, inputs: PauseInputs) -> float:
        return math.inf


def continuum_ttl(inputs: PauseInputs, default_ttl_s: float) -> float:
    """The lease that maximises expected saving minus memory-time held (0: do not pin).

    Over the tool's observed waits w_1 <= ... <= w_n, pinning for t saves the recompute
    waste (``recompute_s`` x device bytes in use) with probability P(W <= t) and holds M for
    E[min(W, t)]. The best t is one of the observed waits (the objective only gains between
    them by holding longer), or 0.
    """
    waits = sorted(w for w in inputs.tool_waits if w >= 0 and math.isfinite(w))
    if not waits:
        return default_ttl_s
    m = inputs.kv_bytes
    saved = decide_pause(inputs).recompute_s * max(inputs.device_used_bytes, m)
    n = len(waits)
    best_t, best = 0.0, 0.0
    below = 0.0  # sum of waits <= t
    for i, t in enumerate(waits):
        below += t
        hits = bisect.bisect_right(waits, t)
        if hits != i + 1:
            continue  # ties: score t once, with all equal waits counted
        held = (below + (n - hits) * t) / n
        value = hits / n * saved - m * held
        if value > best:
            best_t, best = t, value
    return best_t


@dataclass(frozen=True, slots=True)
class Continuum:
    default_ttl_s: float = 10.0
    name: str = "continuum"
    reads_tool_waits: ClassVar[bool] = True

    def decide(self, inputs: PauseInputs) -> PauseDecision:
        ttl = continuum_ttl(inputs, self.default_ttl_s)
        size, tool = format_bytes(inputs.kv_bytes), inputs.tool or "an unnamed tool"
        history = f"{len(inputs.tool_waits)} observed waits of {tool}"
        if not inputs.tool_waits:
            history = f"no waits of {tool} observed yet: the default lease"
        if ttl <= 0:
            action = PauseAction.CACHE
            reason = (
                f"{action.label} (Continuum: no lease pays for itself over {history}): {size} "
                "is unlocked now."
            )
        else:
            action = PauseAction.RETAIN
            reason = (
                f"Retain for {format_seconds(ttl)} (Continuum's time-to-live from {history}), "
                f"then {size} goes to the prefix cache."
            )
        return dataclasses.replace(decide_pause(inputs), action=action, reason=reason)

    def lease_s(self, inputs: PauseInputs) -> float:
        return continuum_ttl(inputs, self.default_ttl_s)
