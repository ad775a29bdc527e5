"""Deploy a fleet on Ray Serve: N engine replicas and the front that routes across them.

Layout (one Ray Serve application each, so each has its own HTTP route prefix):

    kvpilot            at /                     FleetIngress (1 replica): the front, which owns
                                                the prefix directory and routes every request
    kvpilot-replica-0  at /kvpilot-replica-0    EngineReplica (1 replica): kvpilot's own app
    ...                                         on one engine, plus poll/snapshot methods
    kvpilot-replica-N-1

The front forwards HTTP through Ray Serve's proxy to ``/kvpilot-replica-i/...`` and pulls
KV events over each replica's deployment handle. Ray Serve restarts a replica that dies;
the front notices (a failed poll or request), drops it from the directory, re-routes, and
resyncs it from a snapshot once it answers again under a new epoch.

Why not a Ray Serve request router (``RequestRouter.choose_replicas``): it runs inside
every caller's deployment handle (each proxy, each ingress replica), sees only the
request's arguments and a periodically polled ``record_routing_stats`` dict per replica,
and has no channel for an ordered stream of KV events with sequence numbers; every handle
would keep its own directory fed by full snapshots. An ingress that owns one directory,
pulls events in order and resyncs on gaps is exact; addressing replicas as one-replica
applications keeps to Ray Serve's public API.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvpilot.errors import ConfigError
from kvpilot.fleet.scoring import RouterConfig

log = logging.getLogger("kvpilot.fleet")

FRONT_APP = "kvpilot"
REPLICA_APP = "kvpilot-replica-{i}"


@dataclass(frozen=True, slots=True)
class FleetOptions:
    replicas: int = 2
    router: str = "kvpilot"
    router_config: RouterConfig = field(default_factory=RouterConfig)
    ray_address: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    num_cpus: float | None = None  # for a local Ray instance (default: Ray's own)
    replica_num_cpus: float = 0.0
    poll_interval_s: float = 0.25

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be at least 1, got {self.replicas}")


def replica_names(n: int) -> list[str]:
    return [REPLICA_APP.format(i=i) for i in range(n)]


def require_ray() -> Any:
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ConfigError(
            "--replicas needs Ray Serve: pip install 'kvpilot[fleet]' (or 'ray[serve]')"
        ) from exc
    return ray, serve


def build_applications(serve_options: Any, fleet: FleetOptions) -> list[tuple[str, str, Any]]:
    """(application name, route prefix, bound application), replicas first."""
    _, serve = require_ray()
    from kvpilot.fleet.serve.ingress import FleetIngress
    from kvpilot.fleet.serve.replica import EngineReplica

    replica_cls = serve.deployment(
        serve.ingress()(EngineReplica),
        name="EngineReplica",
        num_replicas=1,
        max_ongoing_requests=1024,
        ray_actor_options={"num_cpus": fleet.replica_num_cpus},
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
    )
    front_cls = serve.deployment(
        serve.ingress()(FleetIngress),
        name="FleetIngress",
        num_replicas=1,
        max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": 0},
    )
    names = replica_names(fleet.replicas)
    apps: list[tuple[str, str, Any]] = [
        (name, f"/{name}", replica_cls.bind(name, serve_options)) for name in names
    ]
    proxy = f"http://127.0.0.1:{fleet.port}"
    apps.append((FRONT_APP, "/", front_cls.bind(names, proxy, serve_options, fleet)))
    return apps


def run_applications(apps: list[tuple[str, str, Any]]) -> None:
    """Deploy applications and wait until they run (all at once with ``serve.run_many``)."""
    _, serve = require_ray()
    run_many = getattr(serve, "run_many", None)
    if run_many is not None and len(apps) > 1:
        run_many([serve.RunTarget(bound, name, prefix) for name, prefix, bound in apps])
    else:
        for name, prefix, bound in apps:
            serve.run(bound, name=name, route_prefix=prefix, blocking=False)
    for name, prefix, _ in apps:
        log.info("application %s is up at %s", name, prefix)


def deploy(serve_options: Any, fleet: FleetOptions, *, blocking: bool = True) -> None:
    """Start (or join) Ray, run the fleet on Ray Serve; with ``blocking``, serve until
    interrupted, then tear the applications down."""
    ray, serve = require_ray()
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
        if fleet.ray_address is not None:
            kwargs["address"] = fleet.ray_address
        elif fleet.num_cpus is not None:
            kwargs["num_cpus"] = fleet.num_cpus
        ray.init(**kwargs)
    serve.start(http_options={"host": fleet.host, "port": fleet.port})
    apps = build_applications(serve_options, fleet)
    run_applications(apps[:-1])  # the replicas (in parallel where Serve can), then the front
    run_applications(apps[-1:])
    if not blocking:
        return
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        for name, _, _ in reversed(apps):
            serve.delete(name)
