"""A request in flight, and the (non-streamed) response bodies built from its output."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from kvpilot.engine import Engine, RequestOutput
from kvpilot.promptcache.breaks import PrefixBreak
from kvpilot.promptcache.ledger import ttl_label
from kvpilot.promptcache.usage import Breakpoint
from kvpilot.server.async_engine import RequestStream
from kvpilot.server.prompt_cache import CacheOutcome
from kvpilot.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    GenerationRequest,
    KvpilotInfo,
    PromptTokensDetails,
    Usage,
)
from kvpilot.server.session_registry import ServerSession
from kvpilot.server.state import ServerState
from kvpilot.server.submit import Submitted
from kvpilot.server.tiers import pause_info

DISCONNECT_POLL_S = 0.5  # how often a waiting response checks that its client is still there


@dataclass(slots=True)
class Call:
    """One request in flight: what the response builders need."""

    state: ServerState
    http: Request
    tenant: str | None
    body: GenerationRequest
    chat: bool
    request_id: str
    stream: RequestStream
    submitted: Submitted
    session: ServerSession | None
    created: int
    api_key: str | None = None  # the caller's key id (a digest), for the usage ledger
    prefix_break: PrefixBreak | None = None
    cache: CacheOutcome | None = None  # set by `finish`
    released: bool = False  # its session's `busy` count was given back


def abort_unfinished(call: Call) -> None:
    """The call is over (however it ended): abort its request if it still runs, and release
    its session (it may expire again once idle)."""
    if not call.stream.finished:
        call.state.engine.abort_soon(call.request_id)
    if call.session is not None and not call.released:
        call.released = True
        call.session.busy -= 1
        call.session.last_used = time.time()


async def finish(call: Call, output: RequestOutput) -> KvpilotInfo:
    """Bookkeeping once a request is done: tenant counters, the session's record, and the
    pause the engine decided when a turn that ended on a tool call finished."""
    state = call.state
    state.metrics.record_request(call.tenant, output.prompt_tokens, output.cached_tokens)
    pause = None
    session = call.session
    completed = bool(output.outputs) and output.outputs[0].finish_reason != "abort"
    state.metrics.record_ideal(call.submitted, output)
    call.cache = await _bill(call, output)
    if session is not None:
        session.record_turn(output.prompt_tokens, output.cached_tokens, by_tier(output))
        if call.chat and completed:
            session.messages.append({"role": "assistant", "content": output.outputs[0].text})
        eid, hint = session.engine_id, call.body.pause_hint and completed
        saved = await state.engine.call(lambda engine: _after_turn(engine, eid, hint))
        if saved is not None:  # its tokens, saved off the engine thread
            await state.tokenization.run(saved)
        if hint:
            pause = await state.engine.call(lambda engine: pause_info(engine, eid))
            if pause is not None:
                session.last_pause = pause
        state.sessions.changed(session)
    token_ids = call.body.return_token_ids
    return KvpilotInfo(
        session_id=session.session_id if session else None,
        prompt_divergence_index=call.submitted.divergence_index,
        prefix_break=call.prefix_break.to_json() if call.prefix_break else None,
        prompt_cache=_cache_info(call.cache),
        cached_tokens_by_tier=by_tier(output),
        usage=usage_of(output),
        pause=pause,
        prompt_token_ids=call.submitted.prompt_token_ids if token_ids else None,
        completion_token_ids=[list(o.token_ids) for o in output.outputs] if token_ids else None,
    )


def _after_turn(engine: Engine, engine_id: str, paused: bool) -> Callable[[], object] | None:
    """Engine thread: what saves the session's tokens now (None: a pause saved them)."""
    store = engine.offload.session_store
    session = engine.sessions.get(engine_id)
    if store is None or session is None or paused or engine.offload.record_for(engine_id):
        return None
    tokens, salt = session.tokens, session.salt
    return lambda: store.save(engine_id, tokens, salt, {"action": None})


async def _bill(call: Call, output: RequestOutput) -> CacheOutcome | None:
    """Pin the request's breakpoints, split its usage as a provider bills it, record it."""
    cache = call.state.prompt_cache
    submitted = call.submitted
    if cache is None or submitted.whole_prompt is None:
        return None
    tokens, salt = submitted.whole_prompt, submitted.salt
    breakpoints = [Breakpoint(p, ttl, where) for p, ttl, where in submitted.breakpoints]
    generated = output.generated_tokens

    def after(engine: Engine) -> CacheOutcome:
        return cache.after(engine, tokens, salt, breakpoints, output.cached_tokens, generated)

    outcome = await call.state.engine.call(after)
    cache.bill(outcome.usage, model=call.state.model_name, tenant=call.tenant, api_key=call.api_key)
    return outcome


def _cache_info(outcome: CacheOutcome | None) -> dict[str, Any] | None:
    if outcome is None:
        return None
    u = outcome.usage
    return {
        "input_tokens": u.input_tokens,
        "cache_read_input_tokens": u.cached_read_tokens,
        "cache_creation_input_tokens": u.cache_write_tokens,
        "cache_creation_by_ttl": {ttl_label(t): n for t, n in u.cache_write_tokens_by_ttl.items()},
        "breakpoints": list(outcome.pinned),
    }


def by_tier(output: RequestOutput) -> dict[str, int]:
    return {"device": 0, "host": 0, "disk": 0} | dict(output.cached_tokens_by_tier)


def usage_of(output: RequestOutput) -> Usage:
    completion = output.generated_tokens
    return Usage(
        prompt_tokens=output.prompt_tokens,
        completion_tokens=completion,
        total_tokens=output.prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=output.cached_tokens, cached_tokens_by_tier=by_tier(output)
        ),
    )


def finish_reason(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def completion_response(call: Call, output: RequestOutput, info: KvpilotInfo) -> dict:
    return dump(
        CompletionResponse(
            id=call.request_id,
            created=call.created,
            model=call.state.model_name,
            choices=[
                CompletionChoice(
                    index=o.index, text=o.text, finish_reason=finish_reason(o.finish_reason)
                )
                for o in output.outputs
            ],
            usage=info.usage,
            kvpilot=info.model_copy(update={"usage": None}),
        )
    )


def chat_response(call: Call, output: RequestOutput, info: KvpilotInfo) -> dict:
    return dump(
        ChatCompletionResponse(
            id=call.request_id,
            created=call.created,
            model=call.state.model_name,
            choices=[
                ChatChoice(
                    index=o.index,
                    message=AssistantMessage(content=o.text),
                    finish_reason=finish_reason(o.finish_reason),
                )
                for o in output.outputs
            ],
            usage=info.usage,
            kvpilot=info.model_copy(update={"usage": None}),
        )
    )


def dump(model: BaseModel) -> dict:
    return model.model_dump(mode="json", exclude_none=False)
