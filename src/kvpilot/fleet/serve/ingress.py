"""The front as a Ray Serve deployment: deployment handles to the replicas, HTTP via the
Ray Serve proxy, the router in this one process."""

from __future__ import annotations

from typing import Any

import httpx

from kvpilot.fleet.events import ReplicaSnapshot
from kvpilot.fleet.serve.app import create_front_app
from kvpilot.fleet.serve.front import FleetFront, FrontConfig, ReplicaDown
from kvpilot.fleet.serve.replica import ReplicaHello, ReplicaPoll
from kvpilot.server.tenancy import ApiKeys


class RayReplicaLink:
    """A replica's side channel through its Ray Serve deployment handle."""

    def __init__(self, app_name: str) -> None:
        from ray import serve

        self.handle = serve.get_deployment_handle("EngineReplica", app_name=app_name)

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.handle, method).remote(*args)
        except Exception as exc:  # the actor died, or is being replaced
            raise ReplicaDown(f"{type(exc).__name__}: {exc}") from exc

    async def hello(self) -> ReplicaHello:
        return await self._call("hello")

    async def poll(self, after_seq: int, epoch: str | None) -> ReplicaPoll:
        return await self._call("poll", after_seq, epoch)

    async def snapshot(self) -> ReplicaSnapshot:
        return await self._call("snapshot")


class FleetIngress:
    def __init__(self, replicas: list[str], proxy_url: str, serve_options: Any, fleet: Any) -> None:
        from kvpilot.model.loader import resolve_model_path
        from kvpilot.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_model_path(serve_options.model))
        keys = ApiKeys.from_file(serve_options.api_keys) if serve_options.api_keys else ApiKeys()
        config = FrontConfig(
            model=serve_options.model,
            router=fleet.router,
            router_config=fleet.router_config,
            poll_interval_s=fleet.poll_interval_s,
        )
        links = {name: RayReplicaLink(name) for name in replicas}
        http = httpx.AsyncClient(base_url=proxy_url, timeout=config.request_timeout_s)
        self.front = FleetFront(config, links, http, tokenizer, keys)  # type: ignore[arg-type]
        self.http_app = create_front_app(self.front)

    def __serve_build_asgi_app__(self) -> Any:
        return self.http_app
