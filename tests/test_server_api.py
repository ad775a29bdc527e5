"""`kvpilot serve` end to end: a real server on loopback, the `tiny` model, the OpenAI client."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine import Engine
from kvpilot.server import ApiKeys, ServerLimits, create_app
from kvpilot.server.background import BackgroundServer
from kvpilot.server.state import ServerState

T = TypeVar("T")

ALICE, BOB = "key-alice", "key-bob"
MAX_MODEL_LEN = 1024
LIMITS = ServerLimits(
    max_tokens_limit=256, max_n=4, max_sessions_per_tenant=20, max_body_bytes=1 << 16
)
GREEDY: dict[str, Any] = {"temperature": 0.0}


class Harness:
    def __init__(self, server: BackgroundServer) -> None:
        self.server = server
        self.url = server.base_url
        self.state: ServerState = server.app.state.kvpilot
        self.session = httpx.Client(base_url=self.url, timeout=60)

    def client(self, key: str = ALICE) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def http(
        self, method: str, path: str, key: str | None = ALICE, **kwargs: Any
    ) -> httpx.Response:
        headers = kwargs.pop("headers", {})
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        return self.session.request(method, path, headers=headers, **kwargs)

    def on_engine(self, fn: Callable[[Engine], T]) -> T:
        return self.state.engine.call_blocking(fn, timeout=60)

    def new_session(self, key: str = ALICE, **body: Any) -> str:
        response = self.http("POST", "/v1/sessions", key, json=body or None)
        assert response.status_code == 200, response.text
        return response.json()["id"]


@pytest.fixture(scope="module")
def srv() -> Iterator[Harness]:
    engine = Engine.from_pretrained("tiny", kv_blocks=512, max_model_len=MAX_MODEL_LEN)
    keys = ApiKeys({ALICE: "alice", BOB: "bob"})
    app = create_app(engine, model_name="tiny", limits=LIMITS, api_keys=keys)
    with BackgroundServer(app) as server:
        harness = Harness(server)
        yield harness
        harness.on_engine(lambda e: e.check_invariants())
        harness.session.close()


def kvpilot_info(response: Any) -> dict[str, Any]:
    return response.model_extra["kvpilot"]


# -- the OpenAI surface --------------------------------------------------------------------


def test_models_lists_the_served_model(srv: Harness) -> None:
    models = srv.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_a_completion_reports_usage_with_cached_tokens(srv: Harness) -> None:
    r = srv.client().completions.create(model="tiny", prompt="The cache ", max_tokens=5, **GREEDY)
    assert len(r.choices) == 1 and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len("The cache ")
    assert r.usage.completion_tokens <= 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    details = r.usage.prompt_tokens_details.model_extra["cached_tokens_by_tier"]
    assert details == {"device": 0, "host": 0, "disk": 0}


def test_a_completion_accepts_token_ids(srv: Harness) -> None:
    by_ids = srv.client().completions.create(model="tiny", prompt=[72, 105], max_tokens=4, **GREEDY)
    by_text = srv.client().completions.create(model="tiny", prompt="Hi", max_tokens=4, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_a_chat_completion_applies_the_chat_template(srv: Harness) -> None:
    r = srv.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, **GREEDY
    )
    assert r.choices[0].message.role == "assistant"
    # <|user|> \n h i <|end|> \n <|assistant|> \n
    assert r.usage.prompt_tokens == 8
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_chat_matches_the_plain_answer_and_ends_with_usage(srv: Harness) -> None:
    messages = [{"role": "user", "content": "stream me"}]
    plain = srv.client().chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, **GREEDY
    )
    chunks = list(
        srv.client().chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    final = chunks[-1]
    assert (
        final.usage is not None and final.usage.completion_tokens == plain.usage.completion_tokens
    )
    # The plain request left the prompt's full blocks cached (all but the last token count).
    prompt = plain.usage.prompt_tokens
    assert final.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // 16 * 16
    assert kvpilot_info(final)["usage"]["prompt_tokens"] == plain.usage.prompt_tokens


def test_a_stream_without_include_usage_still_carries_the_extension(srv: Harness) -> None:
    chunks = list(
        srv.client().completions.create(
            model="tiny", prompt="abc", max_tokens=4, stream=True, **GREEDY
        )
    )
    assert all(c.usage is None for c in chunks)
    info = kvpilot_info(chunks[-1])
    assert info["usage"]["prompt_tokens"] == 3
    assert info["cached_tokens_by_tier"]["host"] == 0


def test_n_returns_that_many_choices_plain_and_streamed(srv: Harness) -> None:
    r = srv.client().completions.create(
        model="tiny", prompt="fork me", max_tokens=6, n=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    chunks = list(
        srv.client().completions.create(
            model="tiny", prompt="fork me", max_tokens=6, n=3, temperature=1.0, seed=7, stream=True
        )
    )
    streamed = {i: "" for i in range(3)}
    finished = set()
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    assert streamed == {c.index: c.text for c in r.choices}


def test_a_repeated_prompt_is_served_from_the_prefix_cache(srv: Harness) -> None:
    prompt = "a shared system prompt that spans a few blocks. " * 2
    first = srv.client().completions.create(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    second = srv.client().completions.create(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    assert second.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // 16 * 16
    assert second.choices[0].text == first.choices[0].text


# -- sessions ------------------------------------------------------------------------------


def chat_turn(srv: Harness, session: str, messages: list[dict], **extra: Any) -> Any:
    return srv.client().chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        extra_body={"session_id": session, **extra},
        **GREEDY,
    )


def test_cached_tokens_grow_across_turns_when_only_new_messages_are_sent(srv: Harness) -> None:
    session = srv.new_session()
    cached = []
    for turn in range(3):
        r = chat_turn(srv, session, [{"role": "user", "content": f"turn {turn}: " + "x" * 30}])
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert kvpilot_info(r)["session_id"] == session
    assert cached[0] == 0 and cached[0] < cached[1] < cached[2]
    info = srv.http("GET", f"/v1/sessions/{session}").json()
    assert info["turns"] == 3 and info["tokens"] > 90 and info["blocks"]["held_on_device"] > 0
    assert info["cached_tokens_by_tier"]["device"] == sum(cached)
    assert 0 < info["hit_rate"] < 1


def test_cached_tokens_grow_across_turns_when_the_history_is_resent(srv: Harness) -> None:
    session = srv.new_session()
    messages = [{"role": "system", "content": "You are terse. " * 3}]
    cached, prompt_tokens = [], []
    for turn in range(3):
        messages.append({"role": "user", "content": f"question {turn}: " + "y" * 24})
        r = chat_turn(srv, session, messages)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        prompt_tokens.append(r.usage.prompt_tokens)
    assert cached[0] == 0 and cached[0] < cached[1] < cached[2]
    # Everything up to the previous turn's prompt is reused at least block-aligned.
    assert cached[2] >= prompt_tokens[1] // 16 * 16


def test_a_resent_history_that_diverges_is_reported_and_reuses_the_common_prefix(
    srv: Harness,
) -> None:
    session = srv.new_session()
    first = {"role": "user", "content": "A" * 60}
    r1 = chat_turn(srv, session, [first])
    edited = {"role": "user", "content": "A" * 40 + "B" * 20}
    history = [edited, {"role": "assistant", "content": r1.choices[0].message.content}]
    r2 = chat_turn(srv, session, [*history, {"role": "user", "content": "next"}])
    info = kvpilot_info(r2)
    assert info["prompt_divergence_index"] == 2 + 40  # <|user|> \n then 40 A's
    assert r2.usage.prompt_tokens_details.cached_tokens == 32
    state = srv.http("GET", f"/v1/sessions/{session}").json()
    assert state["last_divergence_index"] == 42 and state["turns"] == 2


def test_completion_turns_on_a_session_reuse_the_history(srv: Harness) -> None:
    session = srv.new_session()
    opening = "Once upon a time, in a cache far away, " * 2
    client = srv.client()
    body = {"session_id": session}
    r1 = client.completions.create(model="tiny", prompt=opening, max_tokens=4, extra_body=body)
    r2 = client.completions.create(model="tiny", prompt=" and then", max_tokens=4, extra_body=body)
    history = r1.usage.prompt_tokens + r1.usage.completion_tokens
    assert r2.usage.prompt_tokens == history + len(" and then")
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(opening) // 16 * 16
    assert kvpilot_info(r2)["prompt_divergence_index"] is None


def test_a_streamed_session_turn_updates_the_session(srv: Harness) -> None:
    session = srv.new_session()
    chunks = list(
        srv.client().chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "stream a turn"}],
            max_tokens=5,
            stream=True,
            extra_body={"session_id": session},
            **GREEDY,
        )
    )
    assert kvpilot_info(chunks[-1])["session_id"] == session
    assert srv.http("GET", f"/v1/sessions/{session}").json()["turns"] == 1


def test_a_forked_session_continues_from_its_parent(srv: Harness) -> None:
    session = srv.new_session()
    chat_turn(srv, session, [{"role": "user", "content": "z" * 50}])
    forks = srv.http("POST", f"/v1/sessions/{session}/fork", json={"n": 2}).json()["forks"]
    assert len(forks) == 2
    for child in forks:
        r = chat_turn(srv, child, [{"role": "user", "content": "branch"}])
        assert r.usage.prompt_tokens_details.cached_tokens >= 48
    for sid in [session, *forks]:
        assert srv.http("DELETE", f"/v1/sessions/{sid}").json()["deleted"] is True


def test_pause_answers_the_policy_decision_with_its_reason(srv: Harness) -> None:
    session = srv.new_session()
    chat_turn(srv, session, [{"role": "user", "content": "work " * 10}])
    response = srv.http(
        "POST", f"/v1/sessions/{session}/pause", json={"expected_wait_s": 2.0, "tool": "pytest"}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    # No host or disk tier on this server: the state stays or is dropped, never moved.
    assert body["action"] in ("retain", "drop") and body["reason"]
    assert body["tool"] == "pytest" and body["expected_wait_s"] == 2.0
    info = srv.http("GET", f"/v1/sessions/{session}").json()
    assert info["paused"] is True and info["last_pause"]["reason"] == body["reason"]


def test_pause_without_a_wait_uses_the_predicted_wait(srv: Harness) -> None:
    session = srv.new_session()
    chat_turn(srv, session, [{"role": "user", "content": "predict"}])
    predicted = srv.on_engine(lambda e: e.offload.waits.predict("ls"))
    body = srv.http("POST", f"/v1/sessions/{session}/pause", json={"tool": "ls"}).json()
    assert body["action"] and (body["expected_wait_s"], body["wait_source"]) == predicted
    assert body["wait_source"] != "hint from the caller"


def test_pausing_a_session_while_its_turn_runs_is_409(srv: Harness) -> None:
    session = srv.new_session()
    stream = srv.client().completions.create(
        model="tiny",
        prompt="long turn",
        max_tokens=250,
        stream=True,
        extra_body={"session_id": session, "ignore_eos": True},
    )
    next(iter(stream))  # the turn is running
    response = srv.http("POST", f"/v1/sessions/{session}/pause", json={"expected_wait_s": 1.0})
    stream.close()
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "session_busy"


def test_a_turn_with_a_tool_wait_hint_reports_the_pause_decision(srv: Harness) -> None:
    session = srv.new_session()
    r = chat_turn(
        srv,
        session,
        [{"role": "user", "content": "call a tool"}],
        expected_tool_wait_s=1.5,
        tool="grep",
    )
    pause = kvpilot_info(r)["pause"]
    assert pause["action"] in ("retain", "offload_host", "offload_disk", "drop") and pause["reason"]
    assert pause["tool"] == "grep" and pause["expected_wait_s"] == 1.5
    info = srv.http("GET", f"/v1/sessions/{session}").json()
    assert info["paused"] is True and info["last_pause"]["action"] == pause["action"]


def test_a_turn_without_a_hint_reports_no_pause(srv: Harness) -> None:
    session = srv.new_session()
    r = chat_turn(srv, session, [{"role": "user", "content": "no tool"}])
    assert kvpilot_info(r)["pause"] is None
    assert srv.http("GET", f"/v1/sessions/{session}").json()["paused"] is False


def test_token_ids_are_returned_when_asked_for(srv: Harness) -> None:
    session = srv.new_session()
    extra = {"session_id": session, "return_token_ids": True, "ignore_eos": True}
    first = srv.client().completions.create(
        model="tiny", prompt="abc", max_tokens=4, extra_body=extra, **GREEDY
    )
    second = srv.client().completions.create(
        model="tiny",
        prompt="de",
        max_tokens=4,
        extra_body={**extra, "session_history": "append"},
        **GREEDY,
    )
    a, b = kvpilot_info(first), kvpilot_info(second)
    assert a["prompt_token_ids"] == [97, 98, 99] and len(a["completion_token_ids"][0]) == 4
    # The second turn's prompt is the whole session: first prompt, its output, the new text.
    assert b["prompt_token_ids"] == a["prompt_token_ids"] + a["completion_token_ids"][0] + [
        100,
        101,
    ]
    assert len(b["prompt_token_ids"]) == second.usage.prompt_tokens
    plain = srv.client().completions.create(model="tiny", prompt="abc", max_tokens=2, **GREEDY)
    assert kvpilot_info(plain)["prompt_token_ids"] is None


def test_a_deleted_session_is_gone(srv: Harness) -> None:
    session = srv.new_session()
    assert srv.http("DELETE", f"/v1/sessions/{session}").status_code == 200
    assert srv.http("GET", f"/v1/sessions/{session}").status_code == 404


def test_sessions_belong_to_their_tenant(srv: Harness) -> None:
    session = srv.new_session(ALICE)
    assert srv.http("GET", f"/v1/sessions/{session}", BOB).status_code == 404
    assert srv.http("DELETE", f"/v1/sessions/{session}", BOB).status_code == 404
    chat_turn_as(srv, ALICE, session)
    # Ids are scoped per tenant: Bob naming the same id gets a session of his own.
    bob = chat_turn_as(srv, BOB, session)
    assert bob.usage.prompt_tokens_details.cached_tokens == 0
    assert srv.http("GET", f"/v1/sessions/{session}", ALICE).json()["turns"] == 1
    assert srv.http("GET", f"/v1/sessions/{session}", BOB).json()["turns"] == 1
    srv.http("DELETE", f"/v1/sessions/{session}", BOB)


def chat_turn_as(srv: Harness, key: str, session: str) -> Any:
    return srv.client(key).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"session_id": session},
    )


def test_a_tenant_cannot_open_more_sessions_than_its_limit(srv: Harness) -> None:
    opened = [srv.new_session(BOB) for _ in range(LIMITS.max_sessions_per_tenant)]
    refused = srv.http("POST", "/v1/sessions", BOB)
    assert refused.status_code == 429 and "DELETE" in refused.json()["error"]["message"]
    for sid in opened:
        srv.http("DELETE", f"/v1/sessions/{sid}", BOB)
    assert srv.http("POST", "/v1/sessions", BOB).status_code == 200


# -- tenants -------------------------------------------------------------------------------


def test_prefixes_are_shared_within_a_tenant_but_never_across_tenants(srv: Harness) -> None:
    prompt = "Tenant isolation test prompt, long enough to fill several KV blocks. " * 2
    args: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    alice = [srv.client(ALICE).completions.create(**args) for _ in range(2)]
    bob = srv.client(BOB).completions.create(**args)
    salted = srv.client(ALICE).completions.create(**args, extra_body={"cache_salt": "private"})
    assert alice[0].usage.prompt_tokens_details.cached_tokens == 0
    assert alice[1].usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // 16 * 16
    assert bob.usage.prompt_tokens_details.cached_tokens == 0
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_requests_without_a_valid_key_get_401(srv: Harness, key: str | None) -> None:
    response = srv.http("POST", "/v1/completions", key, json={"model": "tiny", "prompt": "x"})
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


# -- metrics -------------------------------------------------------------------------------


def scrape(srv: Harness) -> dict[str, float]:
    text = srv.http("GET", "/metrics", key=None).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def test_metrics_parse_and_counters_move(srv: Harness) -> None:
    before = scrape(srv)
    srv.client().completions.create(model="tiny", prompt="metrics " * 6, max_tokens=3, **GREEDY)
    moving = (
        "kvpilot_generation_tokens_total{}",
        "kvpilot_prompt_tokens_total{}",
        "kvpilot_requests_finished_total{}",
        "kvpilot_prefix_cache_queries_tokens_total{}",
        "kvpilot_time_to_first_token_seconds_count{}",
        "kvpilot_e2e_request_latency_seconds_count{}",
        "kvpilot_tenant_prompt_tokens_total{tenant=alice}",
    )
    # The engine thread publishes its snapshot just after the step that answered the
    # request, so a scrape may briefly lag the response: allow it a moment (bounded).
    for _ in range(50):
        after = scrape(srv)
        if all(after.get(n, 0.0) > before.get(n, 0.0) for n in moving):
            break
        time.sleep(0.1)
    for name in moving:
        assert after[name] > before.get(name, 0.0), name
    assert after["kvpilot_inter_token_latency_seconds_count{}"] >= 2
    assert after["kvpilot_kv_blocks{state=total,tier=device}"] == 512
    for action in ("retain", "offload_host", "offload_disk", "drop", "demoted"):
        assert f"kvpilot_pause_decisions_total{{action={action}}}" in after
    for direction in ("device_to_host", "host_to_device", "device_to_disk", "disk_to_device"):
        assert after[f"kvpilot_kv_bytes_moved_total{{direction={direction}}}"] == 0
    assert after["kvpilot_kv_blocks{state=total,tier=host}"] == 0
    assert (
        "kvpilot_prefetch_stalls_total{}" in after and "kvpilot_recomputed_tokens_total{}" in after
    )
    assert "kvpilot_requests_running{}" in after and "kvpilot_preemptions_total{}" in after


# -- bad input -----------------------------------------------------------------------------

BAD_REQUESTS: list[tuple[str, str, Any, int]] = [
    ("malformed JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', 400),
    ("body not an object", "/v1/completions", b"[1, 2]", 400),
    ("missing prompt", "/v1/completions", {"model": "tiny"}, 400),
    ("prompt of the wrong type", "/v1/completions", {"prompt": 5}, 400),
    ("boolean token ids", "/v1/completions", {"prompt": [True, False]}, 400),
    ("token id out of vocabulary", "/v1/completions", {"prompt": [1, 10**9]}, 400),
    ("negative token id", "/v1/completions", {"prompt": [-1]}, 400),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400),
    ("several prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400),
    ("max_tokens as a string", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400),
    ("max_tokens zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("max_tokens over the limit", "/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400),
    ("n over the limit", "/v1/completions", {"prompt": "x", "n": 99}, 400),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400),
    ("empty stop string", "/v1/completions", {"prompt": "x", "stop": [""]}, 400),
    ("unsupported logprobs", "/v1/completions", {"prompt": "x", "logprobs": 3}, 400),
    ("prompt over the context", "/v1/completions", {"prompt": "x" * (MAX_MODEL_LEN + 5)}, 400),
    ("prompt + max_tokens over the context", "/v1/completions",
     {"prompt": "x" * (MAX_MODEL_LEN - 10), "max_tokens": 50}, 400),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404),
    ("invalid session id", "/v1/completions", {"prompt": "x", "session_id": "a b/c"}, 400),
    ("session id too long", "/v1/completions", {"prompt": "x", "session_id": "s" * 129}, 400),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400),
    ("unknown role", "/v1/chat/completions",
     {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("image content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400),
    ("messages not a list", "/v1/chat/completions", {"messages": "hello"}, 400),
    ("oversized body", "/v1/completions", {"prompt": "x" * (LIMITS.max_body_bytes + 1)}, 413),
    ("fork n zero", "/v1/sessions/sess-nope/fork", {"n": 0}, 400),
    ("negative pause wait", "/v1/sessions/sess-nope/pause", {"expected_wait_s": -1.0}, 400),
    ("pause wait as a string", "/v1/sessions/sess-nope/pause", {"expected_wait_s": "5"}, 400),
    ("pause with an unknown field", "/v1/sessions/sess-nope/pause", {"wait": 5}, 400),
    ("pause of an unknown session", "/v1/sessions/sess-nope/pause", {"expected_wait_s": 1.0}, 404),
    ("tool wait without a session", "/v1/completions",
     {"prompt": "x", "expected_tool_wait_s": 1.0}, 400),
    ("tool without a session", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tool": "pytest"}, 400),
    ("negative tool wait", "/v1/completions", {"prompt": "x", "expected_tool_wait_s": -2.0}, 400),
    ("infinite tool wait", "/v1/completions", b'{"prompt": "x", "expected_tool_wait_s": Infinity}',
     400),
    ("no such route", "/v1/nowhere", {}, 404),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status"), [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_input_gets_a_4xx_with_a_message(
    srv: Harness, path: str, body: Any, status: int
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = srv.http("POST", path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert set(error) == {"message", "type", "param", "code"}


def test_n_above_one_on_a_session_turn_is_refused(srv: Harness) -> None:
    session = srv.new_session()
    body = {"prompt": "x", "n": 2, "session_id": session}
    response = srv.http("POST", "/v1/completions", json=body)
    assert response.status_code == 400 and "fork" in response.json()["error"]["message"]


def test_the_server_keeps_serving_after_bad_input(srv: Harness) -> None:
    for _, path, body, _status in BAD_REQUESTS:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        srv.http("POST", path, content=content, headers={"Content-Type": "application/json"})
    health = srv.http("GET", "/health", key=None)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    r = srv.client().completions.create(model="tiny", prompt="still here", max_tokens=2)
    assert r.usage.completion_tokens >= 1
