"""The fleet: prefix-aware routing across engine replicas (Ray Serve, or the simulator).

- `keys`: prompts fingerprinted with the engines' own chained block hash.
- `events`: KV events each replica's radix cache publishes (committed, moved, evicted).
- `directory`: the cluster prefix directory those events feed.
- `scoring`, `migration`: the affinity-load objective and the session migration rule.
- `routers`, `kvpilot_router`, `ray_prefix`: kvpilot's router and the baselines.
- `replica`: the replica side (event log, load reports), shared by Ray Serve and the sim.
- `sim`: a fleet of simulated engines on virtual time, routed by the same code.
- `serve`: `kvpilot serve --replicas N` on Ray Serve (needs the ``fleet`` extra).
"""

from __future__ import annotations

from kvpilot.fleet.directory import PrefixDirectory, TierMatch
from kvpilot.fleet.events import EventBatch, KVEvent, KVEventKind, KVEventLog, ReplicaSnapshot
from kvpilot.fleet.keys import KeySpace, PromptKeyCache
from kvpilot.fleet.load import FleetView, ReplicaLoad, ReplicaView, RouteRequest
from kvpilot.fleet.migration import MigrationDecision, decide_migration
from kvpilot.fleet.routers import ROUTER_NAMES, RouteDecision, Router, make_router
from kvpilot.fleet.scoring import RouterConfig

__all__ = [
    "ROUTER_NAMES",
    "EventBatch",
    "FleetView",
    "KVEvent",
    "KVEventKind",
    "KVEventLog",
    "KeySpace",
    "MigrationDecision",
    "PrefixDirectory",
    "PromptKeyCache",
    "ReplicaLoad",
    "ReplicaSnapshot",
    "ReplicaView",
    "RouteDecision",
    "RouteRequest",
    "Router",
    "RouterConfig",
    "TierMatch",
    "decide_migration",
    "make_router",
]
