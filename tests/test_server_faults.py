"""No request can stop the engine: bounds at the API, clamps in the policy, faults isolated.

A real server on loopback (the `tiny` model, a disk tier, offload-disk so every pause sets a
prefetch timer), the OpenAI client and plain HTTP.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvpilot.engine import Engine
from kvpilot.policy.pause_inputs import MAX_WAIT_S
from kvpilot.server import create_app
from kvpilot.server.background import BackgroundServer
from kvpilot.server.ops import OpsConfig
from kvpilot.server.state import ServerState

GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 4}
LIVENESS_S = 2.0


class Server:
    def __init__(self, server: BackgroundServer) -> None:
        self.url = server.base_url
        self.state: ServerState = server.app.state.kvpilot
        self.http = httpx.Client(base_url=self.url, timeout=60)
        self.openai = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def session(self) -> str:
        response = self.http.post("/v1/sessions")
        assert response.status_code == 200, response.text
        return response.json()["id"]

    def complete(self, prompt: str = "hello there", **extra: Any) -> httpx.Response:
        return self.http.post("/v1/completions", json={"prompt": prompt, **GREEDY, **extra})

    def healthy(self) -> bool:
        return self.http.get("/health").status_code == 200


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    disk = tmp_path_factory.mktemp("disk")
    engine = Engine.from_pretrained(
        "tiny", kv_blocks=64, max_model_len=512, disk_dir=str(disk), pause_policy="offload-disk"
    )
    app = create_app(engine, model_name="tiny", ops=OpsConfig(liveness_s=LIVENESS_S))
    with BackgroundServer(app) as server:
        yield Server(server)


def test_a_wait_longer_than_30_days_is_refused_at_the_api(srv: Server) -> None:
    sid = srv.session()
    for wait in (1e10, MAX_WAIT_S + 1, -1.0):
        response = srv.complete(session_id=sid, expected_tool_wait_s=wait)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "expected_tool_wait_s"
    response = srv.http.post(f"/v1/sessions/{sid}/pause", json={"expected_wait_s": 1e300})
    assert response.status_code == 400, response.text
    ok = srv.complete(session_id=sid, expected_tool_wait_s=MAX_WAIT_S)
    assert ok.status_code == 200, ok.text
    assert srv.healthy()
    assert srv.complete().status_code == 200


def test_the_policy_clamps_a_wait_that_gets_past_the_api(srv: Server) -> None:
    """Python callers reach the policy without the API's bounds: the engine loop survives."""
    sid = srv.session()
    assert srv.complete(session_id=sid).status_code == 200

    def pause(engine: Engine) -> float:
        engine.sessions[sid].pause(1e300)
        record = engine.offload.record_for(sid)
        assert record is not None
        return record.expected_return - record.paused_at

    assert srv.state.engine.call_blocking(pause, timeout=30) == MAX_WAIT_S
    assert srv.complete().status_code == 200
    assert srv.complete(session_id=sid).status_code == 200
    assert srv.healthy()


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(srv: Server) -> None:
    engine = srv.state.engine.engine
    execute = engine.executor.execute
    failures = []

    def broken(works: Any) -> Any:
        engine.executor.execute = execute  # type: ignore[method-assign]
        failures.append(1)
        raise RuntimeError("injected step failure")

    engine.executor.execute = broken  # type: ignore[method-assign]
    try:
        failed = srv.complete("a request that meets a broken step")
        streamed = srv.complete("the next one streams", stream=True)
    finally:
        engine.executor.execute = execute  # type: ignore[method-assign]
    assert failures == [1]
    assert failed.status_code == 500, failed.text
    assert failed.json()["error"]["code"] == "engine_fault"
    assert streamed.status_code == 200 and "[DONE]" in streamed.text
    assert srv.healthy()
    assert srv.http.get("/ready").status_code == 200
    chat = srv.openai.completions.create(model="tiny", prompt="still serving", **GREEDY)
    assert chat.choices[0].text
    assert srv.state.engine.faults >= 1
    srv.state.engine.call_blocking(lambda e: e.check_invariants(), timeout=30)


def test_health_is_a_liveness_check_of_the_loop(srv: Server) -> None:
    body = srv.http.get("/health").json()
    assert body["status"] == "ok" and body["heartbeat_age_s"] < LIVENESS_S
    hang = srv.state.engine.call_soon(lambda engine: time.sleep(LIVENESS_S + 2))
    time.sleep(LIVENESS_S + 0.5)
    stalled = srv.http.get("/health")
    assert stalled.status_code == 503, stalled.text
    assert "stalled" in stalled.json()["engine"]
    hang.result(timeout=30)
    time.sleep(0.2)
    assert srv.healthy()
