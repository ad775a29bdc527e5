"""The server under concurrent streams and client disconnects: nothing fails, no block leaks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvpilot.engine import Engine
from kvpilot.server import ServerLimits, create_app
from kvpilot.server.background import BackgroundServer
from kvpilot.server.state import ServerState

CLIENTS = 32


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    engine = Engine.from_pretrained("tiny", kv_blocks=256, max_model_len=1024)
    app = create_app(engine, limits=ServerLimits(max_tokens_limit=2048))
    with BackgroundServer(app) as running:
        yield running


def state_of(server: BackgroundServer) -> ServerState:
    return server.app.state.kvpilot


def wait_until_idle(server: BackgroundServer, deadline_s: float = 60.0) -> None:
    engine = state_of(server).engine
    end = time.monotonic() + deadline_s
    while engine.call_blocking(lambda e: e.has_unfinished() or bool(e.requests)):
        assert time.monotonic() < end, "the engine never went idle"
        time.sleep(0.05)


def assert_only_the_prefix_cache_holds_blocks(server: BackgroundServer) -> None:
    def check(engine: Engine) -> tuple[int, int, int, int]:
        engine.check_invariants()
        kv = engine.kv
        held = kv.device.num_used
        cached = kv.radix.cached_blocks()
        kv.radix.evict(kv.device.num_blocks)
        return held, cached, kv.device.num_free, len(kv.trajectories)

    held, cached, free, trajectories = state_of(server).engine.call_blocking(check)
    assert trajectories == 0
    assert held == cached
    assert free == 256


def test_concurrent_streaming_clients_all_finish_and_leave_no_blocks_held(
    server: BackgroundServer,
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)
    system = {"role": "system", "content": "You answer in one short line. " * 3}

    async def one(i: int, session: str | None) -> list[int]:
        messages: list[dict[str, Any]] = [system]
        lengths = []
        for turn in range(2 if session else 1):
            messages.append({"role": "user", "content": f"client {i} turn {turn}"})
            stream = await client.chat.completions.create(
                model="tiny",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=12,
                temperature=0.8,
                seed=i,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"session_id": session} if session else None,
            )
            text, usage = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                usage = chunk.usage or usage
            assert usage is not None and 1 <= usage.completion_tokens <= 12
            messages.append({"role": "assistant", "content": text})
            lengths.append(usage.completion_tokens)
        return lengths

    async def main() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            sessions = [
                (await http.post("/v1/sessions")).json()["id"] if i % 2 else None
                for i in range(CLIENTS)
            ]
            results = await asyncio.gather(*(one(i, s) for i, s in enumerate(sessions)))
            for sid in filter(None, sessions):
                assert (await http.delete(f"/v1/sessions/{sid}")).status_code == 200
        await client.close()
        return results

    results = asyncio.run(main())
    assert len(results) == CLIENTS
    assert sum(len(r) for r in results) == CLIENTS // 2 * 3
    wait_until_idle(server)
    assert_only_the_prefix_cache_holds_blocks(server)


def test_a_client_that_disconnects_mid_stream_has_its_request_aborted(
    server: BackgroundServer,
) -> None:
    registry = state_of(server).metrics.registry

    def aborted() -> float:
        return registry.get_sample_value("kvpilot_requests_aborted_total") or 0.0

    before = aborted()
    body = {"prompt": "never finish " * 4, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.base_url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving the block closes the connection mid-stream
    end = time.monotonic() + 60
    while aborted() == before:
        assert time.monotonic() < end, "the request was never aborted"
        time.sleep(0.05)
    wait_until_idle(server)
    assert_only_the_prefix_cache_holds_blocks(server)
    health = httpx.get(f"{server.base_url}/health").json()
    assert health["status"] == "ok" and health["requests"]["running"] == 0
