"""Named serving policies the simulator can run and compare on the same workload and seed.

A policy is a set of `EngineConfig` overrides. Every pause policy of the engine
(`kvpilot.policy.pause.POLICY_NAMES`: breakeven, retain, drop, offload-host, offload-disk,
ttl, lru) is a policy of the same name; ``default`` is the engine's defaults; ``tau-X`` is
any admission ceiling (e.g. ``tau-0.8``); ``no-prefix-cache`` and ``monolithic`` switch off
prefix caching and chunked prefill.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvpilot.engine.config import EngineConfig
from kvpilot.errors import ConfigError
from kvpilot.policy.pause import POLICY_NAMES

DEFAULT_COMPARISON: tuple[str, ...] = ("breakeven", "retain", "offload-host", "drop", "lru")


@dataclass(frozen=True, slots=True)
class SimPolicy:
    name: str
    description: str
    engine_overrides: dict[str, object] = field(default_factory=dict)


POLICIES: dict[str, SimPolicy] = {
    p.name: p
    for p in (
        SimPolicy("default", "engine defaults"),
        SimPolicy(
            "no-prefix-cache",
            "prefix caching off: no sharing across trajectories",
            {"enable_prefix_caching": False},
        ),
        SimPolicy("monolithic", "prefill in one step, not chunked", {"chunked_prefill": False}),
        *(
            SimPolicy(
                name, f"pause policy {name!r} for paused trajectories", {"pause_policy": name}
            )
            for name in POLICY_NAMES
        ),
    )
}


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
    """``config`` with the policy's overrides, and a note when part of it cannot apply."""
    note = None
    if policy.engine_overrides.get("pause_policy") == "offload-disk":
        note = "the simulator has no disk tier: offload-disk decisions fall back as the engine does"
    try:
        overrides: dict[str, Any] = dict(policy.engine_overrides)
        return dataclasses.replace(config, **overrides), note
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"policy {policy.name!r} does not apply to this engine: {exc}") from exc
