"""`kvpilot serve` with host and disk tiers: sessions pause on tool calls, come back from the
tier the policy chose, and answer exactly what a server without tiers answers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.cli.serve import ServeOptions, build_app
from kvpilot.engine import Engine
from kvpilot.engine.config import EngineConfig
from kvpilot.server.background import BackgroundServer

FIRST = "You are a coding agent. The test suite fails; find out why. " * 6  # ~360 tokens
TOOL_RESULT = "Tool result (pytest): 3 failed, 41 passed. "
FINAL = "Tool result (git diff): two lines changed. Summarize."
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8}


class Server:
    def __init__(self, server: BackgroundServer) -> None:
        self.server = server
        self.http = httpx.Client(base_url=server.base_url, timeout=60)
        self.client = openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0
        )

    def on_engine(self, fn: Callable[[Engine], Any]) -> Any:
        return self.server.app.state.kvpilot.engine.call_blocking(fn, timeout=60)

    def new_session(self) -> str:
        return self.http.post("/v1/sessions").json()["id"]

    def turn(self, session: str, prompt: str, **extra: Any) -> Any:
        body = {
            "session_id": session,
            "session_history": "append",
            "ignore_eos": True,
            "return_token_ids": True,
            **extra,
        }
        return self.client.completions.create(
            model="tiny", prompt=prompt, extra_body=body, **GREEDY
        )

    def settle(self) -> None:
        """Wait until the engine has finished moving KV between tiers."""
        deadline = time.monotonic() + 30
        while self.on_engine(lambda e: e.offload.busy()):
            assert time.monotonic() < deadline, "tier copies never finished"
            time.sleep(0.01)

    def session(self, session: str) -> dict[str, Any]:
        return self.http.get(f"/v1/sessions/{session}").json()

    def metrics(self) -> dict[str, float]:
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}"] = sample.value
        return values


@contextmanager
def serve(tmp: Path, policy: str | None, kv_blocks: int = 128, tp: int = 1) -> Iterator[Server]:
    """A server as `kvpilot serve` builds it; with a policy, a host tier and a disk dir; ``tp``
    ranks (`--tp`)."""
    tiers: dict[str, Any] = {}
    if policy is not None:
        tiers = {"host_memory_bytes": 16 << 20, "disk_dir": str(tmp / f"disk-{policy}")}
        tiers["pause_policy"] = policy
    engine = EngineConfig.from_kwargs(kv_blocks=kv_blocks, tensor_parallel_size=tp, **tiers)
    app = build_app(ServeOptions(engine=engine))
    with BackgroundServer(app) as background:
        server = Server(background)
        yield server
        server.on_engine(lambda e: e.check_invariants())
        server.http.close()


def output_ids(response: Any) -> list[int]:
    return response.model_extra["kvpilot"]["completion_token_ids"][0]


@pytest.fixture(scope="module")
def plain_outputs(tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """The three turns' output tokens from a server without tiers."""
    with serve(tmp_path_factory.mktemp("plain"), None) as server:
        session = server.new_session()
        return [output_ids(server.turn(session, p)) for p in (FIRST, TOOL_RESULT, FINAL)]


@pytest.fixture(scope="module")
def host_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("host"), "offload-host") as server:
        yield server


def kvpilot(response: Any) -> dict[str, Any]:
    return response.model_extra["kvpilot"]


@pytest.mark.parametrize(
    ("policy", "tier", "tp"),
    [("offload-host", "host", 1), ("offload-disk", "disk", 1), ("offload-disk", "disk", 2)],
)
def test_a_paused_turn_comes_back_from_the_tier_the_policy_moved_it_to(
    policy: str, tier: str, tp: int, tmp_path: Path, plain_outputs: list[list[int]]
) -> None:
    with serve(tmp_path, policy, tp=tp) as server:
        session = server.new_session()
        first = server.turn(session, FIRST, expected_tool_wait_s=30, tool="pytest")
        pause = kvpilot(first)["pause"]
        assert pause["action"] == f"offload_{tier}" and pause["reason"]
        assert pause["tool"] == "pytest" and pause["expected_wait_s"] == 30
        server.settle()
        info = server.session(session)
        assert info["paused"] is True
        assert info["last_pause"]["action"] == pause["action"]
        assert info["last_pause"]["reason"] == pause["reason"]
        assert info["blocks"]["held_on_device"] == 0
        # Every full block whose KV was computed (the last sampled token's KV never is).
        assert info["blocks"]["full_blocks"] - 1 <= info["blocks"][tier] > 0

        second = server.turn(session, TOOL_RESULT)
        by_tier = second.usage.prompt_tokens_details.model_extra["cached_tokens_by_tier"]
        assert by_tier[tier] >= info["blocks"][tier] * 16 - 16
        assert sum(by_tier.values()) == second.usage.prompt_tokens_details.cached_tokens
        assert kvpilot(second)["cached_tokens_by_tier"] == by_tier
        assert kvpilot(second)["pause"] is None
        third = server.turn(session, FINAL)
        assert [output_ids(r) for r in (first, second, third)] == plain_outputs


def test_metrics_show_bytes_moved_and_decisions(tmp_path: Path) -> None:
    with serve(tmp_path, "offload-host") as server:
        before = server.metrics()
        session = server.new_session()
        server.turn(session, FIRST, expected_tool_wait_s=30, tool="pytest")
        server.settle()
        server.turn(session, TOOL_RESULT)
        after = server.metrics()
    decisions = "kvpilot_pause_decisions_total{action=offload_host}"
    assert after[decisions] == before[decisions] + 1
    for direction in ("device_to_host", "host_to_device"):
        name = f"kvpilot_kv_bytes_moved_total{{direction={direction}}}"
        assert after[name] > before[name], name
    assert after["kvpilot_tier_loaded_tokens_total{tier=host}"] > 0
    assert after["kvpilot_kv_blocks{state=total,tier=host}"] > 0
    assert after["kvpilot_link_bandwidth_bytes_per_second{link=device_host}"] > 0


def test_breakeven_retains_while_device_memory_is_plentiful(tmp_path: Path) -> None:
    with serve(tmp_path, "breakeven", kv_blocks=1024) as server:
        session = server.new_session()
        r = server.turn(session, FIRST, expected_tool_wait_s=30, tool="pytest")
    pause = kvpilot(r)["pause"]
    assert pause["action"] == "retain" and "plentiful" in pause["reason"]


def test_breakeven_keeps_a_session_until_its_room_is_needed_then_demotes_it(
    tmp_path: Path,
) -> None:
    with serve(tmp_path, "breakeven", kv_blocks=64) as server:
        session = server.new_session()
        r = server.turn(session, FIRST * 2, expected_tool_wait_s=30, tool="pytest")
        server.settle()
        kept = server.session(session)
        other = server.new_session()  # a turn that needs the room the paused session holds
        server.turn(other, TOOL_RESULT * 12)
        server.settle()
        moved = server.session(session)
    pause = kvpilot(r)["pause"]
    assert 0.5 <= pause["device_pressure"] < 1.0  # most of the pool, but nobody waits for it
    assert pause["action"] == "retain" and "plentiful" in pause["reason"], pause["reason"]
    assert kept["blocks"]["held_on_device"] > 0
    assert moved["blocks"]["held_on_device"] == 0 and moved["blocks"]["host"] > 0


def test_an_idle_server_prefetches_a_paused_session_before_it_returns(tmp_path: Path) -> None:
    with serve(tmp_path, "offload-host") as server:
        session = server.new_session()
        server.turn(session, FIRST, expected_tool_wait_s=0.3, tool="ls")
        deadline = time.monotonic() + 30
        while server.session(session)["last_pause"]["state"] != "prefetched":
            assert time.monotonic() < deadline, "the prefetch never ran"
            time.sleep(0.02)
        before = server.metrics()["kvpilot_prefetch_hits_total{}"]
        r = server.turn(session, TOOL_RESULT)
        after = server.metrics()["kvpilot_prefetch_hits_total{}"]
    assert after == before + 1
    assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_pause_endpoint_moves_a_session_between_turns(tmp_path: Path) -> None:
    with serve(tmp_path, "offload-disk") as server:
        session = server.new_session()
        server.turn(session, FIRST)
        response = server.http.post(
            f"/v1/sessions/{session}/pause", json={"expected_wait_s": 12.5, "tool": "make"}
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["action"] == "offload_disk" and body["expected_wait_s"] == 12.5
        assert body["break_even_wait_s"] is None or body["break_even_wait_s"] >= 0
        server.settle()
        assert server.session(session)["blocks"]["disk"] > 0
        again = server.turn(session, TOOL_RESULT)
        disk = again.usage.prompt_tokens_details.model_extra["cached_tokens_by_tier"]["disk"]
        assert disk > 0


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"expected_wait_s": -1.0}, 400),
        ({"expected_wait_s": "soon"}, 400),
        ({"expected_wait_s": 1.0, "extra": 1}, 400),
        ({"tool": 5}, 400),
    ],
    ids=["negative", "string", "unknown field", "tool not a string"],
)
def test_bad_pause_requests_answer_4xx(
    body: dict[str, Any], status: int, host_server: Server
) -> None:
    session = host_server.new_session()
    response = host_server.http.post(f"/v1/sessions/{session}/pause", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"]


def test_pausing_a_closed_session_is_404(host_server: Server) -> None:
    session = host_server.new_session()
    host_server.http.delete(f"/v1/sessions/{session}")
    gone = host_server.http.post(f"/v1/sessions/{session}/pause", json={"expected_wait_s": 1.0})
    assert gone.status_code == 404
