"""``POST /v1/completions`` and ``POST /v1/chat/completions``, plain and streamed (SSE)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvpilot.engine import RequestOutput
from kvpilot.server.async_engine import RequestStream
from kvpilot.server.protocol import (
    ApiError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    GenerationRequest,
    KvpilotInfo,
    PromptTokensDetails,
    Usage,
)
from kvpilot.server.session_registry import ServerSession
from kvpilot.server.sessions_api import pause_session
from kvpilot.server.state import ServerState, get_state, get_tenant
from kvpilot.server.submit import (
    PromptSpec,
    SessionSpec,
    Submitted,
    request_adder,
    sampling_params,
)
from kvpilot.server.tenancy import cache_salt

router = APIRouter()

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
DISCONNECT_POLL_S = 0.5


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, tenant: str | None = Depends(get_tenant)
) -> Response:
    prompt = PromptSpec(text_or_ids=body.single_prompt())
    return await _generate(request, tenant, body, prompt, chat=False)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, tenant: str | None = Depends(get_tenant)
) -> Response:
    prompt = PromptSpec(messages=body.template_messages(), tools=body.tools)
    return await _generate(request, tenant, body, prompt, chat=True)


@dataclass(slots=True)
class _Call:
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


async def _generate(
    http: Request, tenant: str | None, body: GenerationRequest, prompt: PromptSpec, *, chat: bool
) -> Response:
    state = get_state(http)
    _validate(state, body)
    requested = (
        body.requested_max_tokens if isinstance(body, ChatCompletionRequest) else body.max_tokens
    )
    session = state.sessions.get(body.session_id, tenant) if body.session_id else None
    if session is not None:
        if body.n != 1:
            raise ApiError(
                400, "n > 1 is not allowed on a session turn: fork the session instead", param="n"
            )
        if body.cache_salt is not None and body.cache_salt != session.cache_salt:
            raise ApiError(
                400,
                "a session's cache_salt is fixed when the session is created "
                '(POST /v1/sessions {"cache_salt": ...})',
                param="cache_salt",
            )
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
    add = request_adder(
        request_id=request_id,
        prompt=prompt,
        params=sampling_params(
            n=body.n,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop_list,
            ignore_eos=body.ignore_eos,
        ),
        requested_max_tokens=requested,
        default_max_tokens=(
            state.limits.max_tokens_limit if chat else COMPLETION_DEFAULT_MAX_TOKENS
        ),
        salt=cache_salt(tenant, body.cache_salt),
        session=(
            SessionSpec(
                session.session_id,
                body.session_history,
                list(session.messages),
                list(session.opening_tokens),
            )
            if session is not None
            else None
        ),
    )
    stream, submitted = await state.engine.submit(add)
    if session is not None:
        if submitted.conversation is not None:
            session.messages = list(submitted.conversation)
        if submitted.opening_tokens is not None:
            session.opening_tokens = submitted.opening_tokens
        session.last_divergence_index = submitted.divergence_index
    call = _Call(
        state, http, tenant, body, chat, request_id, stream, submitted, session, int(time.time())
    )
    if body.stream:
        return EventStream(_events(call), on_close=lambda: _abort_unfinished(call))
    try:
        output = await _wait_finished(call)
    finally:
        _abort_unfinished(call)
    info = await _finish(call, output)
    return JSONResponse((_chat_response if chat else _completion_response)(call, output, info))


def _abort_unfinished(call: _Call) -> None:
    if not call.stream.finished:
        call.state.engine.abort_soon(call.request_id)


def _validate(state: ServerState, body: GenerationRequest) -> None:
    if body.model is not None and body.model != state.model_name:
        raise ApiError(
            404,
            f"model {body.model!r} is not served here; this server serves {state.model_name!r}",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )
    unsupported = body.unsupported_fields()
    if unsupported:
        raise ApiError(
            400,
            f"{', '.join(unsupported)} {'is' if len(unsupported) == 1 else 'are'} not supported "
            "by kvpilot; leave them unset",
            param=unsupported[0],
        )
    state.limits.check_n(body.n)
    if isinstance(body, ChatCompletionRequest):
        state.limits.check_max_tokens(body.max_tokens)
        state.limits.check_max_tokens(body.max_completion_tokens, "max_completion_tokens")
    else:
        state.limits.check_max_tokens(body.max_tokens)


async def _wait_finished(call: _Call) -> RequestOutput:
    while True:
        output = await call.stream.next(DISCONNECT_POLL_S)
        if output is None:
            if await call.http.is_disconnected():
                raise ApiError(499, "the client closed the connection", code="client_closed")
            continue
        if output.finished:
            return output


async def _finish(call: _Call, output: RequestOutput) -> KvpilotInfo:
    """Bookkeeping once a request is done: tenant counters, the session's record, a pause."""
    state = call.state
    state.metrics.record_request(call.tenant, output.prompt_tokens, output.cached_tokens)
    pause = None
    session = call.session
    if session is not None:
        session.record_turn(output.prompt_tokens, output.cached_tokens)
        if call.chat and output.outputs and output.outputs[0].finish_reason != "abort":
            session.messages.append({"role": "assistant", "content": output.outputs[0].text})
        if call.body.expected_tool_wait_s is not None:
            pause = await pause_session(
                state, session, call.body.expected_tool_wait_s, call.body.tool, strict=False
            )
    return KvpilotInfo(
        session_id=session.session_id if session else None,
        prompt_divergence_index=call.submitted.divergence_index,
        cached_tokens_by_tier=_by_tier(output),
        usage=_usage(output),
        pause=pause,
    )


def _by_tier(output: RequestOutput) -> dict[str, int]:
    split = getattr(output, "cached_tokens_by_tier", None)
    if isinstance(split, dict):
        return {"device": 0, "host": 0, "disk": 0} | {str(k): int(v) for k, v in split.items()}
    return {"device": output.cached_tokens, "host": 0, "disk": 0}


def _usage(output: RequestOutput) -> Usage:
    completion = output.generated_tokens
    return Usage(
        prompt_tokens=output.prompt_tokens,
        completion_tokens=completion,
        total_tokens=output.prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=output.cached_tokens, cached_tokens_by_tier=_by_tier(output)
        ),
    )


def _finish_reason(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def _completion_response(call: _Call, output: RequestOutput, info: KvpilotInfo) -> dict:
    return _dump(
        CompletionResponse(
            id=call.request_id,
            created=call.created,
            model=call.state.model_name,
            choices=[
                CompletionChoice(
                    index=o.index, text=o.text, finish_reason=_finish_reason(o.finish_reason)
                )
                for o in output.outputs
            ],
            usage=info.usage,
            kvpilot=info.model_copy(update={"usage": None}),
        )
    )


def _chat_response(call: _Call, output: RequestOutput, info: KvpilotInfo) -> dict:
    return _dump(
        ChatCompletionResponse(
            id=call.request_id,
            created=call.created,
            model=call.state.model_name,
            choices=[
                ChatChoice(
                    index=o.index,
                    message=AssistantMessage(content=o.text),
                    finish_reason=_finish_reason(o.finish_reason),
                )
                for o in output.outputs
            ],
            usage=info.usage,  # type: ignore[arg-type]
            kvpilot=info.model_copy(update={"usage": None}),
        )
    )


def _dump(model: BaseModel) -> dict:
    return model.model_dump(mode="json", exclude_none=False)


# -- streaming -----------------------------------------------------------------------------

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(StreamingResponse):
    """A streaming response that always runs ``on_close`` once it ends, however it ends.

    A client can vanish before the first event is sent, when the event generator has not
    started and closing it runs none of its cleanup.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
            self.on_close()


class _Deltas:
    """New text per choice, holding back what may still change.

    A trailing U+FFFD may be half of a multi-byte character, and the last characters may
    be the start of a stop string the engine will cut; neither is sent until settled.
    """

    def __init__(self, holdback_chars: int) -> None:
        self.holdback = holdback_chars
        self.sent: dict[int, str] = {}
        self.done: set[int] = set()

    def update(self, output: RequestOutput) -> list[tuple[int, str, str | None]]:
        out: list[tuple[int, str, str | None]] = []
        for choice in output.outputs:
            if choice.index in self.done:
                continue
            sent = self.sent.get(choice.index, "")
            finished = choice.finish_reason is not None
            text = choice.text
            if not finished:
                text = text.rstrip("\ufffd")
                text = text[: max(len(sent), len(text) - self.holdback)]
            delta = text[len(sent) :] if text.startswith(sent) else ""
            if delta:
                self.sent[choice.index] = sent + delta
            if finished:
                self.done.add(choice.index)
                out.append((choice.index, delta, _finish_reason(choice.finish_reason)))
            elif delta:
                out.append((choice.index, delta, None))
        return out


def _sse(model: BaseModel | dict) -> str:
    data = (
        model.model_dump(mode="json", exclude_none=True) if isinstance(model, BaseModel) else model
    )
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _outputs(call: _Call) -> AsyncIterator[RequestOutput]:
    """Snapshots until the request finishes; stops quietly if the client goes away."""
    while True:
        output = await call.stream.next(DISCONNECT_POLL_S)
        if output is None:
            if await call.http.is_disconnected():
                return
            continue
        yield output
        if output.finished:
            return


async def _events(call: _Call) -> AsyncIterator[str]:
    chunk = _ChunkMaker(call)
    deltas = _Deltas(max((len(s) for s in call.body.stop_list), default=1) - 1)
    try:
        if call.chat:
            for index in range(call.body.n):
                yield _sse(chunk([(index, None, None)], role=True))
        async for output in _outputs(call):
            if not output.finished:
                for item in deltas.update(output):
                    yield _sse(chunk([item]))
                continue
            info = await _finish(call, output)
            items = deltas.update(output)
            for item in items[:-1]:
                yield _sse(chunk([item]))
            final = chunk(items[-1:], info=info.model_copy(), usage=_usage(output))
            if not call.body.include_usage:
                final = final.model_copy(update={"usage": None})
            yield _sse(final)
            yield "data: [DONE]\n\n"
    except ApiError as exc:
        yield _sse(exc.body())
    finally:
        _abort_unfinished(call)


class _ChunkMaker:
    def __init__(self, call: _Call) -> None:
        self.call = call

    def __call__(
        self,
        items: list[tuple[int, str | None, str | None]],
        *,
        role: bool = False,
        info: KvpilotInfo | None = None,
        usage: Usage | None = None,
    ) -> BaseModel:
        call = self.call
        if call.chat:
            return ChatCompletionChunk(
                id=call.request_id,
                created=call.created,
                model=call.state.model_name,
                choices=[
                    ChatChunkChoice(
                        index=i,
                        delta=ChatDelta(role="assistant", content="")
                        if role
                        else ChatDelta(content=text),
                        finish_reason=reason,
                    )
                    for i, text, reason in items
                ],
                usage=usage,
                kvpilot=info,
            )
        return CompletionResponse(
            id=call.request_id,
            created=call.created,
            model=call.state.model_name,
            choices=[
                CompletionChoice(index=i, text=text or "", finish_reason=reason)
                for i, text, reason in items
            ],
            usage=usage,
            kvpilot=info,
        )
