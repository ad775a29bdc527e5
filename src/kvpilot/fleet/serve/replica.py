"""One engine replica on Ray Serve: kvpilot's own HTTP app, plus the fleet's side channel.

The deployment serves the unchanged single-engine app (`kvpilot.server.app.create_app`:
OpenAI API, sessions, API keys, /metrics) under its own route prefix, and answers the
ingress through its deployment handle: ``hello`` (who it is: name, epoch, key space),
``poll`` (KV events since a sequence number, and its load), ``snapshot`` (every block it
holds, for a resync). Everything that reads the engine runs on the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.fleet.events import EventBatch, ReplicaSnapshot
from kvpilot.fleet.load import ReplicaLoad
from kvpilot.fleet.replica import ReplicaAgent


@dataclass(frozen=True, slots=True)
class ReplicaHello:
    name: str
    epoch: str
    key_space_id: str
    block_size: int
    model: str
    model_fingerprint: str  # hex digest seeding the replica's chained hashes


@dataclass(frozen=True, slots=True)
class ReplicaPoll:
    """``batch`` None: the reader's position is gone (a gap, or another epoch): resync."""

    epoch: str
    batch: EventBatch | None
    load: ReplicaLoad


class EngineReplica:
    """The deployment class (wrapped by `deploy.replica_deployment` with `serve.ingress`)."""

    def __init__(self, name: str, serve_options: Any) -> None:
        from kvpilot.cli.serve import build_app

        self.name = name
        self.model = serve_options.model
        self.http_app = build_app(serve_options)
        state = self.http_app.state.kvpilot
        self.async_engine = state.engine
        self.agent = ReplicaAgent(self.async_engine.engine, name)

    def __serve_build_asgi_app__(self) -> Any:
        return self.http_app

    async def hello(self) -> ReplicaHello:
        agent = self.agent
        space = agent.key_space
        return ReplicaHello(
            self.name,
            agent.epoch,
            agent.key_space_id,
            space.block_size,
            self.model,
            space.model.hex(),
        )

    async def poll(self, after_seq: int, epoch: str | None) -> ReplicaPoll:
        agent = self.agent

        def read(_engine: Any) -> ReplicaPoll:
            return ReplicaPoll(agent.epoch, agent.events_since(after_seq, epoch), agent.load())

        return await self._on_engine_thread(read)

    async def snapshot(self) -> ReplicaSnapshot:
        return await self._on_engine_thread(lambda _engine: self.agent.snapshot())

    async def reset_prefix_cache(self) -> int:
        """Drop every cached block nobody holds, in every tier (like vLLM's
        ``/reset_prefix_cache``); the directory hears the evictions. Returns blocks freed."""

        def reset(engine: Any) -> int:
            radix = engine.kv.radix
            return sum(radix.evict(radix.evictable_blocks(tier), tier) for tier in engine.kv.pools)

        return await self._on_engine_thread(reset)

    async def _on_engine_thread(self, fn: Any) -> Any:
        if self.async_engine.running:
            return await self.async_engine.call(fn)
        return fn(self.async_engine.engine)  # before the app's lifespan started its thread
