"""Named serving policies the simulator can run and compare on the same workload and seed.

A policy is a set of `EngineConfig` overrides, plus (for pause policies) the name of the
engine's pause policy. ``tau-X`` is any admission ceiling, e.g. ``tau-0.8``. Pause policies
(``retain``, ``offload``, ``drop``, ``breakeven``) are passed to the engine as
``EngineConfig.pause_policy`` when the engine has that option; until then they run as the
engine's built-in behaviour (idle sessions keep their KV until a running sequence needs the
blocks, then the least recently used one gives way) and the report says so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvpilot.engine.config import EngineConfig
from kvpilot.errors import ConfigError

PAUSE_POLICIES = ("retain", "offload", "drop", "breakeven")
DEFAULT_COMPARISON: tuple[str, ...] = ("default", "no-prefix-cache", "tau-0.7", "tau-0.95")


@dataclass(frozen=True, slots=True)
class SimPolicy:
    name: str
    description: str
    engine_overrides: dict[str, object] = field(default_factory=dict)
    pause_policy: str | None = None


POLICIES: dict[str, SimPolicy] = {
    p.name: p
    for p in (
        SimPolicy("default", "engine defaults: prefix caching, chunked prefill"),
        SimPolicy(
            "no-prefix-cache",
            "prefix caching off: every turn prefills its whole context",
            {"enable_prefix_caching": False},
        ),
        SimPolicy("monolithic", "prefill in one step, not chunked", {"chunked_prefill": False}),
        *(
            SimPolicy(name, f"pause policy {name!r} for idle trajectories", pause_policy=name)
            for name in PAUSE_POLICIES
        ),
    )
}


def pause_policy_supported() -> bool:
    return "pause_policy" in {f.name for f in dataclasses.fields(EngineConfig)}


def resolve_policy(name: str) -> SimPolicy:
    key = name.strip().lower()
    if key in POLICIES:
        return POLICIES[key]
    if key.startswith("tau-"):
        try:
            tau = float(key[4:])
        except ValueError:
            tau = -1.0
        if not 0.0 < tau <= 1.0:
            raise ConfigError(f"policy {name!r}: tau-X needs X in (0, 1], e.g. tau-0.85")
        return SimPolicy(key, f"admission ceiling tau_high = {tau:g}", {"tau_high": tau})
    raise ConfigError(
        f"unknown policy {name!r}: use one of {', '.join(POLICIES)} or tau-X (e.g. tau-0.8)"
    )


def apply_policy(policy: SimPolicy, config: EngineConfig) -> tuple[EngineConfig, str | None]:
    """``config`` with the policy's overrides, and a note when part of it cannot apply yet."""
    overrides = dict(policy.engine_overrides)
    note = None
    if policy.pause_policy is not None:
        if pause_policy_supported():
            overrides["pause_policy"] = policy.pause_policy
        else:
            note = (
                f"the engine has no pause policies yet: {policy.name!r} runs as its built-in "
                f"behaviour (idle sessions keep KV until a running sequence needs the blocks)"
            )
    try:
        return dataclasses.replace(config, **overrides), note
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"policy {policy.name!r} does not apply to this engine: {exc}") from exc
