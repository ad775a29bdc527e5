"""The fleet's front on real replica servers in one process (no Ray): routing by the
directory, sessions, /metrics, and a replica dying under load."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fleet_local import LocalFleet
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.cli.serve import ServeOptions
from kvpilot.engine.config import EngineConfig

OPTIONS = ServeOptions(
    model="tiny", engine=EngineConfig.from_kwargs(kv_blocks=96, max_model_len=1024)
)
SYSTEM = "You are a careful coding agent. Follow the repository's conventions. " * 6


@pytest.fixture(scope="module")
def fleet() -> Iterator[LocalFleet]:
    with LocalFleet(["r0", "r1"], OPTIONS) as running:
        yield running


def wait_for(condition, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def complete(client: httpx.Client, prompt: str, **extra: object) -> dict:  # type: ignore[type-arg]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, **extra}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def cached(response: dict) -> int:  # type: ignore[type-arg]
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_directory_sends_a_shared_prefix_where_it_is_cached(fleet: LocalFleet) -> None:
    front = fleet.front
    assert front is not None
    wait_for(lambda: all(v.live for v in front.fleet.replicas.values()))
    with httpx.Client(base_url=fleet.url, timeout=120) as client:
        complete(client, SYSTEM + "Task: add a test.")
        wait_for(lambda: any(front.directory.num_blocks(n) for n in ("r0", "r1")))
        holder = max(("r0", "r1"), key=front.directory.num_blocks)
        before = dict(front.routed)
        for i in range(3):
            again = complete(client, SYSTEM + f"Task number {i}: fix the bug.")
            assert cached(again) >= 64
        assert front.routed[holder] - before[holder] == 3


def test_metrics_are_labelled_per_replica(fleet: LocalFleet) -> None:
    with httpx.Client(base_url=fleet.url, timeout=60) as client:
        text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    replicas = {s.labels.get("replica") for f in families.values() for s in f.samples}
    assert {"r0", "r1"} <= replicas
    assert "kvpilot_fleet_routed_requests" in families
    health = httpx.get(f"{fleet.url}/health", timeout=30).json()
    assert health["replicas_up"] == 2 and health["router"] == "kvpilot"


def test_prompt_cache_key_keeps_requests_together(fleet: LocalFleet) -> None:
    front = fleet.front
    assert front is not None
    with httpx.Client(base_url=fleet.url, timeout=120) as client:
        before = dict(front.routed)
        for i in range(4):
            complete(client, f"unrelated prompt {i} " * (i + 1), prompt_cache_key="agent-7")
        moved = {n: front.routed[n] - before[n] for n in before}
        assert sorted(moved.values()) == [0, 4]


def test_a_dead_replica_loses_nothing(fleet: LocalFleet, tmp_path: Path) -> None:
    front = fleet.front
    assert front is not None
    with httpx.Client(base_url=fleet.url, timeout=120) as client:
        sid = client.post("/v1/sessions").json()["id"]
        turn1 = {
            "session_id": sid,
            "messages": [{"role": "user", "content": "List the files."}],
            "max_tokens": 4,
            "temperature": 0.0,
        }
        first = client.post("/v1/chat/completions", json=turn1)
        assert first.status_code == 200, first.text
        home = front.sessions.get(sid, None).replica  # type: ignore[union-attr]
        history = first.json()["usage"]["prompt_tokens"]
        fleet.kill(home)
        turn2 = {
            "session_id": sid,
            "messages": [{"role": "tool", "content": "a.py b.py"}],
            "max_tokens": 4,
            "temperature": 0.0,
        }
        second = client.post("/v1/chat/completions", json=turn2)
        assert second.status_code == 200, second.text
        assert second.json()["kvpilot"]["session_id"] == sid
        # the whole conversation reached the new replica: longer than the first turn
        assert second.json()["usage"]["prompt_tokens"] > history
        record = front.sessions.get(sid, None)
        assert record is not None and record.replica != home and record.moves == 1
        for i in range(4):
            complete(client, SYSTEM + f"after the failure {i}")
        assert not front.fleet[home].live
        assert home not in front.directory.replicas
        info = client.get(f"/v1/sessions/{sid}")
        assert info.status_code == 200 and info.json()["id"] == sid
        health = client.get("/health").json()
        assert health["replicas_up"] == 1


def test_reset_prefix_cache_reaches_the_directory(fleet: LocalFleet) -> None:
    import asyncio

    from kvpilot.memory import Tier

    front = fleet.front
    assert front is not None
    with httpx.Client(base_url=fleet.url, timeout=120) as client:
        complete(client, SYSTEM + "Task: warm the cache.")
    live = [n for n in ("r0", "r1") if n not in fleet.dead]
    wait_for(lambda: any(front.directory.num_blocks(n) for n in live))
    before = {n: front.directory.num_blocks(n) for n in live}
    for name in live:
        assert asyncio.run(fleet.replicas[name].reset_prefix_cache()) >= 0
    # What a session still holds stays; the directory follows the evictions to that.
    held = {n: asyncio.run(fleet.replicas[n].snapshot()).num_blocks(Tier.DEVICE) for n in live}
    wait_for(lambda: all(front.directory.num_blocks(n) == held[n] for n in live))
    assert sum(held.values()) < sum(before.values())
