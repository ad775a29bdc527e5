"""Sessions once, durable, nameable: a client names its session and it exists; after kill -9
and a restart the same id continues, its prefix read back from disk; idle sessions expire
and quotas are per tenant, or per client address without keys, with Retry-After."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvpilot.engine import Engine
from kvpilot.server import ServerLimits, create_app
from kvpilot.server.background import BackgroundServer
from kvpilot.server.process import ServeProcess

GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8}
SYSTEM = "You are a coding agent working in a repository with a long system prompt. " * 3


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_the_readme_example_works_as_written() -> None:
    engine = Engine.from_pretrained("tiny", kv_blocks=128, max_model_len=1024)
    with BackgroundServer(create_app(engine, model_name="tiny")) as server:
        client = _client(server.base_url)
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=16,
            extra_body={"session_id": "agent-1", "expected_tool_wait_s": 30, "tool": "pytest"},
        )
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        assert r.model_extra is not None and r.model_extra["kvpilot"]["session_id"] == "agent-1"
        again = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "tool", "content": "3 passed"}],
            max_tokens=4,
            extra_body={"session_id": "agent-1"},
        )
        assert again.usage is not None and r.usage.completion_tokens > 0
        assert again.usage.prompt_tokens > r.usage.prompt_tokens + 3  # the history came along
        listed = httpx.get(f"{server.base_url}/v1/sessions").json()["data"]
        assert [s["id"] for s in listed] == ["agent-1"] and listed[0]["turns"] == 2


def _turn(url: str, text: str) -> Any:
    """A turn appended to the session's tokens (a completion prompt: no re-tokenised reply)."""
    return _client(url).completions.create(
        model="tiny", prompt=text, extra_body={"session_id": "agent-7"}, **GREEDY
    )


def test_a_session_survives_kill_9_and_its_prefix_comes_back_from_disk(tmp_path: Path) -> None:
    args = ["--kv-blocks", "128", "--disk-dir", str(tmp_path), "--policy", "offload-disk"]
    args += ["--poison-freed-blocks"]
    first = ServeProcess(args)
    with first:
        opened = _client(first.base_url).chat.completions.create(
            model="tiny",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "go"}],
            extra_body={
                "session_id": "agent-7",
                "expected_tool_wait_s": 60.0,
                "tool": "ls",
                "return_token_ids": True,
            },
            **GREEDY,
        )
        assert opened.model_extra is not None
        assert opened.model_extra["kvpilot"]["pause"]["action"] == "offload_disk"
        opening = opened.model_extra["kvpilot"]["prompt_token_ids"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            blocks = httpx.get(f"{first.base_url}/v1/sessions/agent-7").json()["blocks"]
            if blocks["disk"] >= blocks["full_blocks"] > 0:
                break
            time.sleep(0.1)
        assert blocks["disk"] >= blocks["full_blocks"] > 0, blocks
        tokens = httpx.get(f"{first.base_url}/v1/sessions/agent-7").json()["tokens"]
        assert first._proc is not None
        first._proc.kill()  # SIGKILL: no shutdown, no flush
        first._proc.wait(30)
    with ServeProcess(args) as second:
        record = httpx.get(f"{second.base_url}/v1/sessions/agent-7")
        assert record.status_code == 200, record.text
        assert record.json()["tokens"] == tokens and record.json()["turns"] == 1
        # A plain request resending that history finds its blocks on disk by chained hash.
        plain = _client(second.base_url).completions.create(
            model="tiny", prompt=opening, max_tokens=1, temperature=0.0
        )
        assert plain.model_extra is not None
        assert plain.model_extra["kvpilot"]["cached_tokens_by_tier"]["disk"] >= (
            (len(opening) - 1) // 16 * 16
        )
        resumed = _turn(second.base_url, "and next")
        assert resumed.model_extra is not None
        info = resumed.model_extra["kvpilot"]
        assert resumed.usage is not None and resumed.usage.prompt_tokens > tokens
        assert resumed.usage.prompt_tokens_details is not None
        assert resumed.usage.prompt_tokens_details.cached_tokens >= (tokens - 1) // 16 * 16
        assert info["prompt_divergence_index"] is None  # it continued, not restarted


@pytest.fixture()
def short_lived() -> Iterator[str]:
    engine = Engine.from_pretrained("tiny", kv_blocks=128, max_model_len=1024)
    limits = ServerLimits(max_sessions_per_tenant=2, session_ttl_s=1.5)
    with BackgroundServer(create_app(engine, model_name="tiny", limits=limits)) as server:
        yield server.base_url


def test_anonymous_quotas_are_per_client_and_idle_sessions_expire(short_lived: str) -> None:
    url = short_lived
    one = httpx.Client(base_url=url, transport=httpx.HTTPTransport(local_address="127.0.0.1"))
    two = httpx.Client(base_url=url, transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    with one, two:
        for sid in ("a", "b"):
            turn = {"prompt": "x", "session_id": sid, "max_tokens": 1}
            assert one.post("/v1/completions", json=turn).status_code == 200
        refused = one.post("/v1/completions", json={"prompt": "x", "session_id": "c"})
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "too_many_sessions"
        assert 1 <= int(refused.headers["retry-after"]) <= 2
        assert one.post("/v1/sessions").status_code == 429
        assert two.post("/v1/sessions").status_code == 200  # another client's bucket
        time.sleep(float(refused.headers["retry-after"]) + 1.5)
        assert one.get("/v1/sessions/a").status_code == 404  # expired
        assert one.post("/v1/completions", json={"prompt": "x", "session_id": "c"}).is_success
