"""`kvpilot serve --replicas 2` on a local Ray instance: two `tiny` replicas behind the
front, a prefix routed to where it is cached, and one replica killed under a session.

One Ray instance for the module (start-up is the slow part); skipped without the fleet
extra.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from kvpilot.cli.serve import ServeOptions  # noqa: E402
from kvpilot.engine.config import EngineConfig  # noqa: E402
from kvpilot.fleet.serve.deploy import FleetOptions, deploy, replica_names  # noqa: E402
from kvpilot.server.process import free_port  # noqa: E402

pytestmark = pytest.mark.ray

SYSTEM = "You are a careful coding agent. Follow the repository's conventions. " * 6


@pytest.fixture(scope="module")
def fleet_url() -> Iterator[str]:
    port = free_port()
    options = ServeOptions(
        model="tiny", engine=EngineConfig.from_kwargs(kv_blocks=96, max_model_len=1024)
    )
    fleet = FleetOptions(replicas=2, port=port, num_cpus=2, poll_interval_s=0.2)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    try:
        deploy(options, fleet, blocking=False)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _health(url).get("replicas_up") == 2, 400)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def _health(url: str) -> dict:  # type: ignore[type-arg]
    try:
        return httpx.get(f"{url}/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}


def wait_until(condition, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the fleet"
        time.sleep(0.5)


def complete(client: httpx.Client, prompt: str) -> dict:  # type: ignore[type-arg]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_fleet_routes_to_the_cache_and_survives_a_dead_replica(fleet_url: str) -> None:
    with httpx.Client(base_url=fleet_url, timeout=120) as client:
        complete(client, SYSTEM + "Task: add a test.")
        time.sleep(1.0)  # a poll brings the replica's KV events to the directory
        hits = [complete(client, SYSTEM + f"Task {i}: fix it.") for i in range(3)]
        assert all(h["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64 for h in hits)
        text = client.get("/metrics").text
        assert 'replica="kvpilot-replica-0"' in text and 'replica="kvpilot-replica-1"' in text

        sid = client.post("/v1/sessions").json()["id"]
        turn = {
            "session_id": sid,
            "max_tokens": 4,
            "temperature": 0.0,
            "messages": [{"role": "user", "content": "List the files."}],
        }
        first = client.post("/v1/chat/completions", json=turn)
        assert first.status_code == 200, first.text
        # kill the replica that holds the session: its actor dies, Ray Serve replaces it
        holder = None
        for name in replica_names(2):
            info = client.get(f"/{name}/v1/sessions/{sid}")
            if info.status_code == 200:
                holder = name
        assert holder is not None
        actors = [
            a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if f"SERVE_REPLICA::{holder}#" in a["name"]
        ]
        assert len(actors) == 1
        ray.kill(
            ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True
        )
        turn2 = {
            "session_id": sid,
            "max_tokens": 4,
            "temperature": 0.0,
            "messages": [{"role": "tool", "content": "a.py b.py"}],
        }
        second = client.post("/v1/chat/completions", json=turn2)
        assert second.status_code == 200, second.text
        assert second.json()["usage"]["prompt_tokens"] > first.json()["usage"]["prompt_tokens"]
        for i in range(3):
            complete(client, SYSTEM + f"after the failure {i}")
        text = client.get("/metrics").text
        retries = [
            line
            for line in text.splitlines()
            if line.startswith("kvpilot_fleet_request_retries_total ")
        ]
        assert retries and float(retries[0].split()[1]) >= 1  # the lost turn was sent again
