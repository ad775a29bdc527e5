"""A fleet in one process for tests: each replica's real kvpilot app on its own loopback
server, the front on another, and a transport that sends ``/{replica}/...`` to it.

``kill(name)`` stops a replica's server for good (connections are refused, its side channel
fails), as a dead process would look to the front.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx

from kvpilot.cli.serve import ServeOptions
from kvpilot.fleet.serve.app import create_front_app
from kvpilot.fleet.serve.front import FleetFront, FrontConfig, ReplicaDown
from kvpilot.fleet.serve.replica import EngineReplica
from kvpilot.server.background import BackgroundServer
from kvpilot.server.tenancy import ApiKeys


class _Transport(httpx.AsyncBaseTransport):
    def __init__(self, fleet: LocalFleet) -> None:
        self.fleet = fleet
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        name, _, rest = request.url.path.lstrip("/").partition("/")
        server = self.fleet.servers.get(name)
        if server is None or name in self.fleet.dead:
            raise httpx.ConnectError(f"replica {name} refused the connection", request=request)
        request.url = httpx.URL(f"{server.base_url}/{rest}", params=request.url.params)
        return await self.inner.handle_async_request(request)


class _Link:
    def __init__(self, fleet: LocalFleet, name: str) -> None:
        self.fleet = fleet
        self.name = name

    def _replica(self) -> EngineReplica:
        if self.name in self.fleet.dead:
            raise ReplicaDown(f"replica {self.name} is dead")
        return self.fleet.replicas[self.name]

    async def hello(self) -> Any:
        return await self._replica().hello()

    async def poll(self, after_seq: int, epoch: str | None) -> Any:
        return await self._replica().poll(after_seq, epoch)

    async def snapshot(self) -> Any:
        return await self._replica().snapshot()


class LocalFleet:
    def __init__(
        self,
        names: list[str],
        options: ServeOptions,
        router: str = "kvpilot",
        api_keys: ApiKeys | None = None,
    ) -> None:
        self.names = names
        self.options = options
        self.router = router
        self.api_keys = api_keys
        self.replicas: dict[str, EngineReplica] = {}
        self.servers: dict[str, BackgroundServer] = {}
        self.dead: set[str] = set()
        self.front: FleetFront | None = None
        self.front_server: BackgroundServer | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> LocalFleet:
        for name in self.names:
            replica = EngineReplica(name, self.options)
            self.replicas[name] = replica
            self.servers[name] = self._stack.enter_context(BackgroundServer(replica.http_app))
        first = next(iter(self.replicas.values()))
        config = FrontConfig(model=self.options.model, router=self.router, poll_interval_s=0.05)
        http = httpx.AsyncClient(transport=_Transport(self), base_url="http://fleet")
        self.front = FleetFront(
            config,
            {name: _Link(self, name) for name in self.names},  # type: ignore[misc]
            http,
            first.async_engine.engine.tokenizer,
            self.api_keys,
        )
        self.front_server = self._stack.enter_context(
            BackgroundServer(create_front_app(self.front))
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def url(self) -> str:
        assert self.front_server is not None
        return self.front_server.base_url

    def kill(self, name: str) -> None:
        self.dead.add(name)
        self.servers[name].__exit__(None, None, None)

    def engines(self) -> Iterator[Any]:
        for name, replica in self.replicas.items():
            if name not in self.dead:
                yield name, replica.async_engine
