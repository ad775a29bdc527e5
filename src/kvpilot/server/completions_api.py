"""``POST /v1/completions`` and ``POST /v1/chat/completions``, plain and streamed (SSE)."""

from __future__ import annotations

import secrets
import time
from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from kvpilot.engine import RequestOutput
from kvpilot.promptcache.breaks import PromptView
from kvpilot.server.prompt_cache import RETENTION_24H_S
from kvpilot.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
)
from kvpilot.server.responses import (
    DISCONNECT_POLL_S,
    Call,
    abort_unfinished,
    chat_response,
    completion_response,
    finish,
)
from kvpilot.server.session_ops import engine_salt, resolve
from kvpilot.server.state import ServerState, authorization, client_address, get_state, get_tenant
from kvpilot.server.streaming import EventStream, events
from kvpilot.server.submit import (
    BreakpointSpec,
    PromptSpec,
    SessionSpec,
    Submitted,
    request_adder,
    sampling_params,
    tokenize,
)
from kvpilot.server.tenancy import cache_salt, key_id

router = APIRouter()

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
PREFIX_BREAK_HEADER = "x-kvpilot-prefix-break"


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


async def _generate(
    http: Request, tenant: str | None, body: GenerationRequest, prompt: PromptSpec, *, chat: bool
) -> Response:
    call = await start_call(http, tenant, body, prompt, chat=chat)
    headers = prefix_break_header(call)
    if body.stream:
        return EventStream(events(call), on_close=lambda: abort_unfinished(call), headers=headers)
    try:
        output = await _wait_finished(call)
    finally:
        abort_unfinished(call)
    info = await finish(call, output)
    body_json = (chat_response if chat else completion_response)(call, output, info)
    return JSONResponse(body_json, headers=headers)


def prefix_break_header(call: Call) -> dict[str, str]:
    brk = call.prefix_break
    return {PREFIX_BREAK_HEADER: brk.header()} if brk is not None else {}


def with_retention(prompt: PromptSpec, body: GenerationRequest) -> PromptSpec:
    """``prompt_cache_retention: "24h"``: the whole prompt is pinned for a day, in the tier
    the break-even rule picks for such a wait (disk or host when there is one)."""
    if body.prompt_cache_retention != "24h" or prompt.messages is None:
        return prompt
    bp = BreakpointSpec(prompt.messages, prompt.tools, RETENTION_24H_S, "prompt_cache_retention")
    return replace(prompt, breakpoints=(*prompt.breakpoints, bp))


def break_group(tenant: str | None, body: GenerationRequest) -> tuple[str, ...] | None:
    """Whose previous request a request is compared with: its session's, or its
    ``prompt_cache_key`` group's (per tenant)."""
    if body.session_id is not None:
        return ("session", tenant or "", body.session_id)
    if body.prompt_cache_key is not None:
        return ("key", tenant or "", body.prompt_cache_key)
    return None


async def start_call(
    http: Request, tenant: str | None, body: GenerationRequest, prompt: PromptSpec, *, chat: bool
) -> Call:
    """Validate, submit to the engine, and compare with the group's previous request."""
    state = get_state(http)
    _validate(state, body)
    prompt = with_retention(prompt, body)
    requested = (
        body.requested_max_tokens if isinstance(body, ChatCompletionRequest) else body.max_tokens
    )
    session = None
    if body.session_id is not None:  # created on first use
        client = client_address(http)
        salt_in = body.cache_salt
        create = body.session_create
        session = resolve(state, tenant, client, body.session_id, create=create, salt=salt_in)
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
    elif body.pause_hint:
        raise ApiError(
            400,
            "expected_tool_wait_s and tool pause a session when its turn ends: send them "
            "with a session_id (any id of yours: the session is created on first use)",
            param="expected_tool_wait_s" if body.expected_tool_wait_s is not None else "tool",
        )
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
    spec = (
        SessionSpec(
            session.engine_id,
            body.session_history,
            list(session.messages),
            list(session.opening_tokens),
            has_history=bool(session.opening_tokens),
            salt=engine_salt(session),
            expected_tool_wait_s=body.expected_tool_wait_s,
            tool=body.tool,
        )
        if session is not None
        else None
    )
    # Off the engine thread: a prompt that cannot fit is refused before it is tokenised, and
    # tokenising (the cost that grows with the prompt) runs on the worker pool.
    tokenization = state.tokenization
    tokenization.check_size(prompt.text_or_ids, prompt.messages, prompt.tools)
    tokenized = await tokenization.run(
        lambda: tokenize(tokenization.engine, tokenization.renderer, prompt, spec)
    )
    add = request_adder(
        request_id=request_id,
        prompt=prompt,
        tokenized=tokenized,
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
        session=spec,
        keep_prompt_ids=body.return_token_ids,
        ideal=state.metrics.ideal,
    )
    if session is not None:
        session.busy += 1  # until `release`: an active session never expires
    try:
        stream, submitted = await state.engine.submit(add)
    except BaseException:
        if session is not None:
            session.busy -= 1
        raise
    if session is not None:
        if submitted.conversation is not None:
            session.messages = list(submitted.conversation)
        if submitted.opening_tokens is not None:
            session.opening_tokens = submitted.opening_tokens
        session.last_divergence_index = submitted.divergence_index
    call = Call(
        state,
        http,
        tenant,
        body,
        chat,
        request_id,
        stream,
        submitted,
        session,
        int(time.time()),
        api_key=key_id(authorization(http)),
    )
    group = break_group(tenant, body)
    if group is not None and state.prompt_cache is not None and submitted.whole_prompt:
        call.prefix_break = state.prompt_cache.observe(group, _view(prompt, submitted))
    return call


def _view(prompt: PromptSpec, submitted: Submitted) -> PromptView:
    tokens = submitted.whole_prompt or []
    if prompt.messages is None:
        return PromptView(tokens, submitted.prompt_text)
    messages = submitted.conversation if submitted.conversation is not None else prompt.messages
    return PromptView.of_chat(tokens, submitted.prompt_text, messages, prompt.tools)


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


async def _wait_finished(call: Call) -> RequestOutput:
    """The request's final output; its client's connection is checked every
    `DISCONNECT_POLL_S` meanwhile, outputs or not, and a client gone aborts the request."""
    check_at = time.monotonic() + DISCONNECT_POLL_S
    while True:
        output = await call.stream.next(DISCONNECT_POLL_S)
        if output is not None and output.finished:
            return output
        if time.monotonic() >= check_at:
            if await call.http.is_disconnected():
                raise ApiError(499, "the client closed the connection", code="client_closed")
            check_at = time.monotonic() + DISCONNECT_POLL_S
