"""Routers behind one interface: kvpilot's, and the baselines it is measured against.

Every router picks one replica for a `RouteRequest` from a `FleetView` and hears back when
the request was sent (``on_routed``), finished, and when a replica leaves. The same objects
run in the Ray Serve ingress and in the fleet simulator.

Baselines:

- ``round_robin``: the next live replica in turn.
- ``power_of_two``: two live replicas at random, the one with fewer requests in flight
  (Ray Serve's default request router).
- ``session_hash``: consistent hashing (a ring of virtual nodes) on the session id, or the
  prompt_cache_key; requests with neither hash on their id.
- ``ray_prefix``: Ray Serve LLM's PrefixCacheAffinityRouter, re-implemented
  (`kvpilot.fleet.ray_prefix`).
"""

from __future__ import annotations

import bisect
import hashlib
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from kvpilot.fleet.load import FleetView, ReplicaView, RouteRequest
from kvpilot.fleet.migration import MigrationDecision

ROUTER_NAMES = ("kvpilot", "round_robin", "power_of_two", "session_hash", "ray_prefix")


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where a request goes, and why. ``matched_tokens``: the prefix the router expects the
    replica to hold (device-equivalent; 0 for routers that do not know)."""

    replica: str
    reason: str
    matched_tokens: float = 0.0
    score: float | None = None
    migration: MigrationDecision | None = None


class Router(Protocol):
    name: str

    def route(self, request: RouteRequest, now: float) -> RouteDecision: ...

    def on_routed(self, request: RouteRequest, decision: RouteDecision, now: float) -> None: ...

    def on_finished(self, request: RouteRequest, replica: str) -> None: ...

    def on_replica_removed(self, replica: str) -> None: ...


class _Base(ABC):
    """Bookkeeping every router shares: queue lengths and pending tokens on the views."""

    name = "base"

    @abstractmethod
    def route(self, request: RouteRequest, now: float) -> RouteDecision: ...

    def __init__(self, fleet: FleetView, seed: int = 0) -> None:
        self.fleet = fleet
        self.rng = random.Random(seed)

    def on_routed(self, request: RouteRequest, decision: RouteDecision, now: float) -> None:
        new = max(0, len(request.tokens) - int(decision.matched_tokens))
        self.fleet[decision.replica].on_routed(now, new)

    def on_finished(self, request: RouteRequest, replica: str) -> None:
        view = self.fleet.replicas.get(replica)
        if view is not None:
            view.on_finished()

    def on_replica_removed(self, replica: str) -> None:  # noqa: B027 (most keep no state)
        """Forget ``replica`` (routers with per-replica state override this)."""

    def _least_ongoing(self, views: list[ReplicaView]) -> ReplicaView:
        low = min(v.ongoing for v in views)
        return self.rng.choice([v for v in views if v.ongoing == low])


class RoundRobinRouter(_Base):
    name = "round_robin"

    def __init__(self, fleet: FleetView, seed: int = 0) -> None:
        super().__init__(fleet, seed)
        self._next = 0

    def route(self, request: RouteRequest, now: float) -> RouteDecision:
        live = self.fleet.require_live()
        view = live[self._next % len(live)]
        self._next += 1
        return RouteDecision(view.name, "round robin")


class PowerOfTwoRouter(_Base):
    name = "power_of_two"

    def route(self, request: RouteRequest, now: float) -> RouteDecision:
        live = self.fleet.require_live()
        pair = self.rng.sample(live, min(2, len(live)))
        view = self._least_ongoing(pair)
        return RouteDecision(view.name, f"fewer requests in flight of {len(pair)} sampled")


class SessionHashRouter(_Base):
    """Consistent hashing: a replica leaving moves only the keys it owned."""

    name = "session_hash"
    VIRTUAL_NODES = 64

    def __init__(self, fleet: FleetView, seed: int = 0) -> None:
        super().__init__(fleet, seed)
        self._ring: list[tuple[int, str]] = []
        self._members: frozenset[str] = frozenset()

    def _build(self, live: list[ReplicaView]) -> None:
        names = frozenset(v.name for v in live)
        if names == self._members:
            return
        self._members = names
        self._ring = sorted(
            (_hash64(f"{name}#{i}"), name) for name in names for i in range(self.VIRTUAL_NODES)
        )

    def route(self, request: RouteRequest, now: float) -> RouteDecision:
        self._build(self.fleet.require_live())
        key = request.affinity or request.request_id
        i = bisect.bisect(self._ring, (_hash64(key), "")) % len(self._ring)
        return RouteDecision(self._ring[i][1], f"consistent hash of {key.split(':')[0]}")


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def make_router(name: str, fleet: FleetView, **options: object) -> Router:
    """A router by name; ``options`` go to kvpilot's router (directory, config, keys, seed)."""
    from kvpilot.errors import ConfigError
    from kvpilot.fleet.kvpilot_router import KvpilotRouter
    from kvpilot.fleet.ray_prefix import RayPrefixRouter

    seed = int(options.pop("seed", 0))  # type: ignore[call-overload]
    if name == "kvpilot":
        return KvpilotRouter(fleet, seed=seed, **options)  # type: ignore[arg-type]
    simple: dict[str, type[_Base]] = {
        "round_robin": RoundRobinRouter,
        "power_of_two": PowerOfTwoRouter,
        "session_hash": SessionHashRouter,
        "ray_prefix": RayPrefixRouter,
    }
    cls = simple.get(name)
    if cls is None:
        raise ConfigError(f"unknown router {name!r}; known: {', '.join(ROUTER_NAMES)}")
    return cls(fleet, seed=seed)
