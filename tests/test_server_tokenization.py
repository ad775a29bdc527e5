"""Prompts are tokenised off the engine thread, and one too long to fit is refused before it
is tokenised at all (a multi-megabyte prompt must not freeze every stream)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpilot.engine import Engine
from kvpilot.server import ServerLimits, create_app
from kvpilot.server.background import BackgroundServer

GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 4}


class RecordingTokenizer:
    """The model's tokenizer, noting which thread encodes or renders and how much."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((threading.current_thread().name, len(text)))
        return self._tokenizer.encode(text, *args, **kwargs)

    def apply_chat_template(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
        size = sum(len(str(m.get("content", ""))) for m in messages)
        self.calls.append((threading.current_thread().name, size))
        return self._tokenizer.apply_chat_template(messages, *args, **kwargs)


@pytest.fixture(scope="module")
def srv() -> Iterator[tuple[httpx.Client, RecordingTokenizer]]:
    engine = Engine.from_pretrained("tiny", kv_blocks=128, max_model_len=1024)
    recorder = RecordingTokenizer(engine.tokenizer)
    engine.tokenizer = recorder
    limits = ServerLimits(max_body_bytes=8 << 20)
    with (
        BackgroundServer(create_app(engine, model_name="tiny", limits=limits)) as server,
        httpx.Client(base_url=server.base_url, timeout=120) as http,
    ):
        yield http, recorder


def test_the_engine_thread_never_tokenises_a_prompt(
    srv: tuple[httpx.Client, RecordingTokenizer],
) -> None:
    http, recorder = srv
    recorder.calls.clear()
    chat = {"messages": [{"role": "user", "content": "hello"}], **GREEDY}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    assert http.post("/v1/completions", json={"prompt": "hello", **GREEDY}).status_code == 200
    sid = http.post("/v1/sessions").json()["id"]
    for text in ("first turn", " and the next"):
        turn = {"prompt": text, "session_id": sid, **GREEDY}
        assert http.post("/v1/completions", json=turn).status_code == 200
    threads = {name for name, _ in recorder.calls}
    assert recorder.calls and "kvpilot-engine" not in threads, threads


def test_a_prompt_too_large_to_fit_is_refused_before_tokenising(
    srv: tuple[httpx.Client, RecordingTokenizer],
) -> None:
    http, recorder = srv
    recorder.calls.clear()
    huge = "lorem ipsum dolor sit amet " * 150_000  # ~4 MB
    for path, body in (
        ("/v1/completions", {"prompt": huge, **GREEDY}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}], **GREEDY}),
    ):
        response = http.post(path, json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "context_length_exceeded"
    assert all(size < 1000 for _, size in recorder.calls), "the huge prompt was tokenised"
    # One that passes the size bound but not the context: tokenised (off the engine), refused.
    medium = "x" * 3000
    response = http.post("/v1/completions", json={"prompt": medium, **GREEDY})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert http.post("/v1/completions", json={"prompt": "still fine", **GREEDY}).status_code == 200
