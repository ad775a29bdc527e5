"""``POST /v1/messages``: Anthropic's Messages API, plain and streamed, with prompt caching.

The request runs through the same path as ``/v1/chat/completions`` (one request model,
`completions_api.start_call`); only the wire format differs. Its ``usage`` is what the
engine did: ``cache_read_input_tokens`` the tokens reused, ``cache_creation_input_tokens``
the tokens computed and pinned at its breakpoints (by TTL), ``input_tokens`` the rest.
A streamed reply is the event sequence the official client expects: ``message_start``,
``content_block_start``, ``ping``, ``content_block_delta``..., ``content_block_stop``,
``message_delta`` (stop reason, usage), ``message_stop``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from kvpilot.engine import Engine, RequestOutput
from kvpilot.server.anthropic_protocol import MessagesRequest, stop_reason, usage_body
from kvpilot.server.completions_api import _wait_finished, prefix_break_header, start_call
from kvpilot.server.protocol import ApiError
from kvpilot.server.responses import Call, abort_unfinished, finish
from kvpilot.server.state import get_state, get_tenant
from kvpilot.server.streaming import Deltas, EventStream, outputs
from kvpilot.server.submit import PromptSpec

router = APIRouter()


@router.post("/v1/messages", response_model=None)
async def messages(
    body: MessagesRequest, request: Request, tenant: str | None = Depends(get_tenant)
) -> Response:
    state = get_state(request)
    chat = body.to_chat_request()
    breakpoints = body.breakpoints()
    cache = state.prompt_cache
    prompt = PromptSpec(messages=chat.template_messages(), tools=chat.tools)
    if breakpoints:
        prompt = replace(
            prompt,
            breakpoints=breakpoints,
            reuse_limit=cache.reuse_limit if cache is not None else None,
        )
    call = await start_call(request, tenant, chat, prompt, chat=True)
    call.request_id = "msg_" + call.request_id.removeprefix("chatcmpl-")
    headers = prefix_break_header(call)
    if body.stream:
        return EventStream(
            _events(call, body), on_close=lambda: abort_unfinished(call), headers=headers
        )
    try:
        output = await _wait_finished(call)
    finally:
        abort_unfinished(call)
    info = await finish(call, output)
    message = await _message(call, body, output)
    message["kvpilot"] = info.model_dump(mode="json", exclude={"usage"})
    return JSONResponse(message, headers=headers)


def _usage(call: Call, output: RequestOutput) -> dict[str, Any]:
    cache = call.cache
    if cache is None:  # no prompt cache on this server: the engine's hit is the read
        read = output.cached_tokens
        return usage_body(output.prompt_tokens - read, read, {}, output.generated_tokens)
    u = cache.usage
    return usage_body(
        u.input_tokens, u.cached_read_tokens, dict(u.cache_write_tokens_by_ttl), u.output_tokens
    )


async def _stop_sequence(call: Call, body: MessagesRequest, output: RequestOutput) -> str | None:
    """Which stop sequence ended the reply (the engine cut the text before it)."""
    choice = output.outputs[0] if output.outputs else None
    if choice is None or choice.finish_reason != "stop" or not body.stop_sequences:
        return None
    ids = list(choice.token_ids)

    def decode(engine: Engine) -> str:
        assert engine.tokenizer is not None
        return str(engine.tokenizer.decode(ids, skip_special_tokens=True))

    full = await call.state.engine.call(decode)
    for s in body.stop_sequences:
        if full.startswith(s, len(choice.text)) or s in full[len(choice.text) :]:
            return s
    return None


async def _message(call: Call, body: MessagesRequest, output: RequestOutput) -> dict[str, Any]:
    choice = output.outputs[0] if output.outputs else None
    stop = await _stop_sequence(call, body, output)
    return {
        "id": call.request_id,
        "type": "message",
        "role": "assistant",
        "model": call.state.model_name,
        "content": [{"type": "text", "text": choice.text if choice else ""}],
        "stop_reason": stop_reason(choice.finish_reason if choice else None, stop),
        "stop_sequence": stop,
        "usage": _usage(call, output),
    }


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def _events(call: Call, body: MessagesRequest) -> AsyncIterator[str]:
    start: dict[str, Any] = {
        "id": call.request_id,
        "type": "message",
        "role": "assistant",
        "model": call.state.model_name,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        # Input usage is final only once the engine has run: message_delta carries it.
        "usage": usage_body(call.submitted.prompt_tokens, 0, {}, 0),
    }
    deltas = Deltas(max((len(s) for s in body.stop_sequences or ()), default=1) - 1)
    try:
        yield _event("message_start", {"message": start})
        yield _event(
            "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
        )
        yield _event("ping", {})
        async for output in outputs(call):
            for _, text, _ in deltas.update(output):
                if text:
                    delta = {"type": "text_delta", "text": text}
                    yield _event("content_block_delta", {"index": 0, "delta": delta})
            if not output.finished:
                continue
            await finish(call, output)
            message = await _message(call, body, output)
            yield _event("content_block_stop", {"index": 0})
            yield _event(
                "message_delta",
                {
                    "delta": {
                        "stop_reason": message["stop_reason"],
                        "stop_sequence": message["stop_sequence"],
                    },
                    "usage": message["usage"],
                },
            )
            yield _event("message_stop", {})
    except ApiError as exc:
        yield _event("error", {"error": {"type": "api_error", "message": exc.message}})
    finally:
        abort_unfinished(call)
