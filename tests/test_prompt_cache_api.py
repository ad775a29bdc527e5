"""Provider-style prompt caching end to end: the official anthropic and openai clients
against a real server on loopback, TTLs on an injected clock."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine import Engine
from kvpilot.server import ApiKeys, ServerLimits, create_app
from kvpilot.server.background import BackgroundServer
from kvpilot.server.prompt_cache import PromptCacheConfig
from kvpilot.server.state import ServerState

KEYS = {"key-a": "alice", "key-b": "bob", "key-ledger": "ledger"}
BLOCK = 16
SYSTEM = "You are a careful coding agent. " * 8  # ~256 byte tokens: well past the minimum
TOOLS: list[dict[str, Any]] = [
    {"name": "bash", "description": "run a command", "input_schema": {"type": "object"}},
]


GREEDY = {"temperature": 0.0}


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Harness:
    def __init__(self, server: BackgroundServer, clock: FakeClock) -> None:
        self.url = server.base_url
        self.clock = clock
        self.state: ServerState = server.app.state.kvpilot
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def anthropic(self, key: str = "key-a") -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0)

    def openai(self, key: str = "key-a") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def metric(self, name: str, **labels: str) -> float:
        text = self.http.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return sample.value
        return 0.0


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    engine = Engine.from_pretrained("tiny", kv_blocks=512, max_model_len=1024)
    clock = FakeClock()
    config = PromptCacheConfig(
        min_cacheable_tokens=64,
        ledger_dir=tmp_path_factory.mktemp("ledger"),
        clock=clock,
    )
    app = create_app(
        engine,
        model_name="tiny",
        limits=ServerLimits(max_tokens_limit=64),
        api_keys=ApiKeys(KEYS),
        prompt_cache=config,
    )
    with BackgroundServer(app) as server:
        harness = Harness(server, clock)
        yield harness
        harness.state.engine.call_blocking(lambda e: e.check_invariants(), timeout=60)
        harness.state.engine.call_blocking(
            lambda e: harness.state.prompt_cache.pins.check_invariants()
        )


def cached_system(text: str = SYSTEM, ttl: str = "5m") -> list[dict[str, Any]]:
    return [{"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": ttl}}]


def ask(
    client: anthropic.Anthropic, user: str, system: Any = None, **kw: Any
) -> anthropic.types.Message:
    return client.messages.create(
        model="tiny",
        max_tokens=kw.pop("max_tokens", 4),
        system=cached_system() if system is None else system,
        messages=[{"role": "user", "content": user}],
        extra_body={"temperature": 0.0, **kw.pop("extra_body", {})},
        **kw,
    )


def info(message: Any) -> dict[str, Any]:
    return message.model_extra["kvpilot"]


def total_input(u: Any) -> int:
    return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def test_system_breakpoint_writes_then_reads_its_length(srv: Harness) -> None:
    client = srv.anthropic()
    system = cached_system("Breakpoint test. " + SYSTEM)
    first = ask(client, "List the files.", system)
    u1 = first.usage
    (bp,) = info(first)["prompt_cache"]["breakpoints"]
    assert bp["where"] == "system[0]" and bp["tier"] in ("device", "host", "disk")
    assert u1.cache_read_input_tokens == 0
    assert u1.cache_creation_input_tokens == bp["pinned_tokens"] == bp["position"] // BLOCK * BLOCK
    assert u1.cache_creation_input_tokens > 0
    assert u1.cache_creation.ephemeral_5m_input_tokens == u1.cache_creation_input_tokens
    assert total_input(u1) == info(first)["prompt_cache"]["input_tokens"] + bp["pinned_tokens"]
    second = ask(client, "Now show me the README, please.", system)
    u2 = second.usage
    assert u2.cache_read_input_tokens == bp["pinned_tokens"]  # the breakpoint's length
    assert u2.cache_creation_input_tokens == 0
    assert u2.input_tokens == total_input(u2) - bp["pinned_tokens"]
    assert second.content[0].type == "text" and second.stop_reason in ("end_turn", "max_tokens")


def test_expired_ttl_turns_the_read_back_into_a_write(srv: Harness) -> None:
    client = srv.anthropic()
    system = cached_system("TTL test. " + SYSTEM)
    written = ask(client, "a", system).usage.cache_creation_input_tokens
    srv.clock.t += 200
    assert ask(client, "b", system).usage.cache_read_input_tokens == written  # refreshes it
    srv.clock.t += 200  # 400 s after the write, 200 s after the last hit: still alive
    assert ask(client, "c", system).usage.cache_read_input_tokens == written
    srv.clock.t += 301
    again = ask(client, "d", system).usage
    assert again.cache_read_input_tokens == 0
    assert again.cache_creation_input_tokens == written


def test_one_hour_ttl_outlives_five_minutes(srv: Harness) -> None:
    client = srv.anthropic()
    system = cached_system("Long TTL. " + SYSTEM, ttl="1h")
    first = ask(client, "a", system).usage
    assert first.cache_creation.ephemeral_1h_input_tokens == first.cache_creation_input_tokens > 0
    srv.clock.t += 1800
    assert ask(client, "b", system).usage.cache_read_input_tokens == (
        first.cache_creation_input_tokens
    )


def test_breakpoints_on_tools_and_last_user_turn(srv: Harness) -> None:
    client = srv.anthropic()
    tools = [{**TOOLS[0], "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    turn = [{"type": "text", "text": "Fix the failing test in utils. " * 3,
             "cache_control": {"type": "ephemeral"}}]  # fmt: skip
    kw: dict[str, Any] = {"tools": tools, "system": "Tools test. " + SYSTEM}
    first = client.messages.create(
        model="tiny", max_tokens=4, extra_body=GREEDY,
        messages=[{"role": "user", "content": turn}], **kw,
    )  # fmt: skip
    u = first.usage
    bps = info(first)["prompt_cache"]["breakpoints"]
    assert [b["where"] for b in bps] == ["tools[0]", "messages[0].content[0]"]
    assert u.cache_creation.ephemeral_1h_input_tokens == bps[0]["pinned_tokens"] > 0
    assert u.cache_creation.ephemeral_5m_input_tokens == (
        bps[1]["pinned_tokens"] - bps[0]["pinned_tokens"]
    )
    history = [
        {"role": "user", "content": turn},
        {"role": "assistant", "content": first.content[0].text or "ok"},
        {"role": "user", "content": "Done?"},
    ]
    second = client.messages.create(
        model="tiny", max_tokens=4, messages=history, extra_body=GREEDY, **kw
    )
    assert second.usage.cache_read_input_tokens == bps[1]["pinned_tokens"]


def test_short_breakpoint_caches_nothing(srv: Harness) -> None:
    message = ask(srv.anthropic(), "hi", cached_system("Short."))
    assert message.usage.cache_creation_input_tokens == 0
    (bp,) = info(message)["prompt_cache"]["breakpoints"]
    assert "minimum cacheable" in bp["skipped"]


def test_longer_ttl_after_shorter_is_refused(srv: Harness) -> None:
    client = srv.anthropic()
    late = [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model="tiny", max_tokens=4, system=cached_system(),
            messages=[{"role": "user", "content": late}],
        )  # fmt: skip
    assert err.value.status_code == 400
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "longer ttl" in err.value.body["error"]["message"]
    five = [
        {"type": "text", "text": f"p{i}", "cache_control": {"type": "ephemeral"}} for i in range(5)
    ]
    with pytest.raises(anthropic.BadRequestError, match="maximum of 4"):
        client.messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": five}]
        )


def test_streaming_event_sequence_and_same_text(srv: Harness) -> None:
    client = srv.anthropic()
    plain = ask(client, "Stream me.", max_tokens=12)
    events = list(
        client.messages.create(
            model="tiny", max_tokens=12, extra_body=GREEDY, system=cached_system(),
            messages=[{"role": "user", "content": "Stream me."}], stream=True,
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"ping", "content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == plain.content[0].text
    delta = events[-2]
    assert delta.delta.stop_reason == plain.stop_reason
    read = delta.usage.cache_read_input_tokens
    assert read == plain.usage.cache_read_input_tokens + plain.usage.cache_creation_input_tokens
    assert delta.usage.output_tokens == plain.usage.output_tokens
    with client.messages.stream(
        model="tiny", max_tokens=12, extra_body=GREEDY, system=cached_system(),
        messages=[{"role": "user", "content": "Stream me."}],
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.content[0].text == plain.content[0].text


def test_stop_sequences_and_max_tokens(srv: Harness) -> None:
    client = srv.anthropic()
    long = ask(client, "Say something.", max_tokens=24)
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 24
    text = long.content[0].text
    stop = text[:1]  # the greedy tiny model's first character
    assert stop
    cut = ask(client, "Say something.", max_tokens=24, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_errors_in_anthropic_shape(srv: Harness) -> None:
    with pytest.raises(anthropic.NotFoundError) as err:
        srv.anthropic().messages.create(
            model="gpt-9", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        srv.anthropic("wrong").messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    raw = srv.http.post("/v1/messages", json={"model": "tiny"}, headers={"x-api-key": "key-a"})
    assert raw.status_code == 400
    assert raw.json()["type"] == "error" and "max_tokens" in raw.json()["error"]["message"]


def test_ledger_totals_equal_the_responses_usage(srv: Harness) -> None:
    client = srv.anthropic("key-ledger")
    seen = {"input_tokens": 0, "cached_read_tokens": 0, "cache_write_tokens": 0, "output_tokens": 0}
    system = cached_system("Ledger. " + SYSTEM)
    for user in ("one", "two", "three"):
        u = ask(client, user, system).usage
        seen["input_tokens"] += u.input_tokens
        seen["cached_read_tokens"] += u.cache_read_input_tokens
        seen["cache_write_tokens"] += u.cache_creation_input_tokens
        seen["output_tokens"] += u.output_tokens
    chat = srv.openai("key-ledger").chat.completions.create(
        model="tiny", max_tokens=3, messages=[{"role": "user", "content": "openai too"}]
    )
    cached = chat.usage.prompt_tokens_details.cached_tokens
    seen["input_tokens"] += chat.usage.prompt_tokens - cached
    seen["cached_read_tokens"] += cached
    seen["output_tokens"] += chat.usage.completion_tokens
    report = srv.http.get("/v1/usage", headers={"Authorization": "Bearer key-ledger"}).json()
    totals = report["totals"]
    assert {k: totals[k] for k in seen} == seen
    assert totals["requests"] == 4
    assert {r["tenant"] for r in report["data"]} == {"ledger"}
    assert all(r["api_key_id"] and "key" not in r["api_key_id"] for r in report["data"])
    # Defaults: cached reads cost 10% of input, writes 125%, output 4 per million.
    expected = (
        seen["input_tokens"] * 1.0
        + seen["cached_read_tokens"] * 0.1
        + seen["cache_write_tokens"] * 1.25
        + seen["output_tokens"] * 4.0
    ) / 1e6
    assert totals["cost"] == pytest.approx(expected)
    other = srv.http.get("/v1/usage", headers={"Authorization": "Bearer key-b"}).json()
    assert other["totals"]["requests"] == 0  # tenant-scoped
    assert (
        srv.metric("kvpilot_usage_tokens_total", tenant="ledger", kind="cached_read")
        == (seen["cached_read_tokens"])
    )
    bad = srv.http.get("/v1/usage?start=yesterday", headers={"Authorization": "Bearer key-b"})
    assert bad.status_code == 400 and "ISO 8601" in bad.json()["error"]["message"]


def test_volatile_head_reported_in_header_metric_and_session(
    srv: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvpilot.prefix_break")
    sid = srv.http.post("/v1/sessions", headers={"Authorization": "Bearer key-a"}).json()["id"]
    client = srv.anthropic()
    before = srv.metric("kvpilot_prefix_breaks_total", cause="volatile_field_at_head")
    headers = []
    for stamp in ("2025-06-01 10:31:07", "2025-06-01 10:32:44"):
        raw = client.messages.with_raw_response.create(
            model="tiny", max_tokens=2,
            system=f"Current time: {stamp}\n" + SYSTEM,
            messages=[{"role": "user", "content": "status?"}],
            extra_body={"session_id": sid, **GREEDY},
        )  # fmt: skip
        headers.append(raw.headers.get("x-kvpilot-prefix-break"))
    assert headers[0] is None
    assert headers[1] is not None and "cause=volatile_field_at_head" in headers[1]
    assert "field=system" in headers[1]
    after = srv.metric("kvpilot_prefix_breaks_total", cause="volatile_field_at_head")
    assert after == before + 1
    session = srv.http.get(f"/v1/sessions/{sid}", headers={"Authorization": "Bearer key-a"})
    body = session.json()
    assert body["prefix_breaks"] == {"volatile_field_at_head": 1}
    assert body["last_prefix_break"]["volatile"]["old"] == "10:31:07"
    assert 0.0 <= body["h_prefix"] < 1.0
    logged = [
        json.loads(r.getMessage()) for r in caplog.records if r.name == "kvpilot.prefix_break"
    ]
    assert [x["cause"] for x in logged if x["group"] == ["session", "alice", sid]] == [
        "volatile_field_at_head"
    ]
    assert logged[-1]["event"] == "prefix_break" and logged[-1]["field"] == "system"


def test_session_turn_with_a_tool_wait_pauses(srv: Harness) -> None:
    sid = srv.http.post("/v1/sessions", headers={"Authorization": "Bearer key-a"}).json()["id"]
    message = ask(
        srv.anthropic(),
        "run the tests",
        extra_body={"session_id": sid, "expected_tool_wait_s": 5.0},
    )
    assert info(message)["session_id"] == sid
    assert info(message)["pause"] is not None and info(message)["pause"]["action"]


def test_openai_prompt_cache_key_groups_requests(srv: Harness) -> None:
    client = srv.openai()
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    more = [*tools, {"type": "function", "function": {"name": "grep", "parameters": {}}}]
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "go"}]
    got = []
    for t in (tools, more):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", max_tokens=2, messages=base, tools=t,
            extra_body={"prompt_cache_key": "agent-7"},
        )  # fmt: skip
        got.append(raw.headers.get("x-kvpilot-prefix-break"))
        body = json.loads(raw.text)
    assert got[0] is None and got[1] is not None and "cause=tool_list_changed" in got[1]
    assert body["kvpilot"]["prefix_break"]["detail"].startswith("the tool list changed")


def test_openai_retention_24h_pins_the_prompt(srv: Harness) -> None:
    client = srv.openai("key-b")
    messages = [
        {"role": "system", "content": "Retention. " + SYSTEM},
        {"role": "user", "content": "x"},
    ]
    first = client.chat.completions.create(
        model="tiny", max_tokens=2, messages=messages,
        extra_body={"prompt_cache_retention": "24h"},
    )  # fmt: skip
    (bp,) = first.model_extra["kvpilot"]["prompt_cache"]["breakpoints"]
    assert bp["ttl_s"] == 86400 and bp["pinned_tokens"] > 0
    srv.clock.t += 7200  # two hours later the prefix is still pinned
    again = client.chat.completions.create(model="tiny", max_tokens=2, messages=messages)
    assert again.usage.prompt_tokens_details.cached_tokens >= bp["pinned_tokens"]
