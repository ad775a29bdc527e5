"""Turning a validated request body into an engine request.

Two halves: `tokenize` renders and tokenises the prompt on a worker thread (it needs no engine
state, and a long prompt must not stall the engine thread); `request_adder` makes the engine
command that adds the request, which reads and changes engine state, so it runs on the
engine thread in one go: a session's tokens cannot change between reading them and
submitting the turn.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvpilot.engine import Engine, SamplingParams
from kvpilot.errors import InvalidRequest, SessionBusy
from kvpilot.server.chat_render import ChatRenderer
from kvpilot.server.limits import resolve_max_tokens
from kvpilot.server.protocol import SessionHistory
from kvpilot.server.turns import (
    chat_resends_history,
    common_prefix_len,
    completion_resends_history,
    plan_turn,
)
from kvpilot.trace.ideal import IdealHitMeter

log = logging.getLogger("kvpilot.server")


@dataclass(frozen=True, slots=True)
class BreakpointSpec:
    """A cache breakpoint: the request cut right after the marked block (rendered without a
    generation prompt, its common prefix with the whole prompt is the breakpoint's position)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    ttl_s: float
    where: str


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """A request's prompt before tokenization: chat messages, or a completion prompt."""

    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    text_or_ids: str | list[int] | None = None
    breakpoints: tuple[BreakpointSpec, ...] = ()
    # Engine thread: how many cached tokens a request of these tokens may reuse (prompt
    # caching with breakpoints reads only pinned prefixes); None: no limit.
    reuse_limit: Callable[[list[int], str | None], int | None] | None = None


@dataclass(frozen=True, slots=True)
class SessionSpec:
    session_id: str
    mode: SessionHistory
    conversation: list[dict[str, Any]]  # the chat conversation as of the session's last turn
    opening_tokens: list[int]
    has_history: bool = False  # the session has had a turn (as the server saw it)
    salt: str | None = None  # the engine salt the session is opened with on first use
    # Either set: the turn ends on a tool call, and the engine pauses the session then.
    expected_tool_wait_s: float | None = None
    tool: str | None = None


@dataclass(frozen=True, slots=True)
class Submitted:
    prompt_tokens: int
    divergence_index: int | None = None
    conversation: list[dict[str, Any]] | None = None  # the whole conversation of this turn
    opening_tokens: list[int] | None = None  # set when this turn (re)started the trajectory
    prompt_token_ids: list[int] | None = None  # the whole prompt, when the client asked for it
    # What an unbounded cache would serve of the whole prompt, and that prompt, for the
    # ideal meter (`ServerMetrics.ideal`): set when a meter was given.
    ideal_cached_tokens: int = 0
    whole_prompt: list[int] | None = None
    salt: str | None = None
    prompt_text: str | None = None  # the rendered chat prompt (for the prefix-break report)
    breakpoints: tuple[tuple[int, float, str], ...] = ()  # (position, ttl_s, where)


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A request's prompt as tokens, made off the engine thread."""

    tokens: list[int]  # the prompt as sent (a chat: the conversation below, rendered)
    text: str | None = None  # the rendered chat prompt, or the completion prompt's text
    conversation: list[dict[str, Any]] | None = None  # a chat: the conversation rendered
    full_chat: bool = False  # a chat whose conversation is the client's whole history
    appended: list[int] | None = None  # a completion appended to a session's history
    breakpoints: tuple[tuple[int, float, str], ...] = ()  # (position, ttl_s, where)


def tokenize(
    engine: Engine,
    renderer: ChatRenderer | None,
    prompt: PromptSpec,
    session: SessionSpec | None,
) -> Tokenized:
    """Worker thread: render and tokenise ``prompt`` (reads only the engine's constants)."""
    text: str | None
    if prompt.messages is not None:
        messages = prompt.messages
        full = session is None or not session.has_history
        if session is not None and not full:
            full = chat_resends_history(session.mode, messages)
            if not full:
                messages = session.conversation + messages
        text, tokens = render_chat_text(renderer, messages, prompt.tools)
        if not tokens:
            raise InvalidRequest("the prompt is empty")
        check_fits(engine, len(tokens))
        positions = breakpoint_positions(renderer, prompt, tokens) if full else ()
        return Tokenized(tokens, text, messages, full, None, positions)
    assert prompt.text_or_ids is not None
    tokens = encode(engine, prompt.text_or_ids, special=True)
    text = prompt.text_or_ids if isinstance(prompt.text_or_ids, str) else None
    appended = None
    if session is None:
        if not tokens:
            raise InvalidRequest("the prompt is empty")
        check_fits(engine, len(tokens))
    elif session.has_history and not completion_resends_history(
        session.mode, tokens, session.opening_tokens
    ):
        appended = encode(engine, prompt.text_or_ids, special=False)
    return Tokenized(tokens, text, appended=appended)


def render_chat_text(
    renderer: ChatRenderer | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    generation_prompt: bool = True,
) -> tuple[str, list[int]]:
    """The chat prompt's text and tokens (message content never becomes control tokens). A
    template that does not render tools gets them as JSON at the start of the system message,
    so that they reach the model."""
    template = getattr(renderer.tokenizer, "chat_template", None) if renderer else None
    if renderer is None or not template:
        raise InvalidRequest(
            "this model has no chat template: use /v1/completions with a plain prompt"
        )
    if tools and "tools" not in str(template):
        messages, tools = tools_in_system(messages, tools), None
    return renderer.render(messages, tools, generation_prompt=generation_prompt)


def tools_in_system(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Tools as JSON lines before the system prompt (one system message, made if none)."""
    block = "# Tools\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = block + "\n\n" + str(first.get("content") or "")
        return [first, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def breakpoint_positions(
    renderer: ChatRenderer | None, prompt: PromptSpec, whole: list[int]
) -> tuple[tuple[int, float, str], ...]:
    """Where each breakpoint falls in ``whole`` (tokens), by rendering the request cut there."""
    out = []
    for bp in prompt.breakpoints:
        _, cut = render_chat_text(renderer, bp.messages, bp.tools, generation_prompt=False)
        out.append((common_prefix_len(cut, whole), bp.ttl_s, bp.where))
    return tuple(out)


def encode(engine: Engine, prompt: str | list[int], *, special: bool) -> list[int]:
    tokens = engine.encode(prompt, add_special_tokens=special)
    if tokens:
        engine.limits.validate_tokens(tokens)
    return tokens


def check_fits(engine: Engine, total: int) -> None:
    """The engine's own admission checks, made before anything is changed."""
    engine.limits.check_fits(total)


def request_adder(
    *,
    request_id: str,
    prompt: PromptSpec,
    tokenized: Tokenized,
    params: SamplingParams,
    requested_max_tokens: int | None,
    default_max_tokens: int,
    salt: str | None,
    session: SessionSpec | None,
    keep_prompt_ids: bool = False,
    ideal: IdealHitMeter | None = None,
) -> Callable[[Engine], tuple[str, Submitted]]:
    """An engine command that adds the request (or session turn) and describes what it did."""

    def add(engine: Engine) -> tuple[str, Submitted]:
        if session is not None:
            return _add_turn(engine, session)
        tokens, text = tokenized.tokens, tokenized.text
        final = _with_max_tokens(engine, len(tokens))
        breakpoints = tokenized.breakpoints
        limit = prompt.reuse_limit(tokens, salt) if prompt.reuse_limit is not None else None
        engine.add_request(tokens, final, request_id=request_id, salt=salt)
        if limit is not None:
            for seq in engine.requests[request_id].seqs:
                seq.traj.reuse_limit = limit
        submitted = Submitted(
            prompt_tokens=len(tokens),
            prompt_token_ids=tokens if keep_prompt_ids else None,
            prompt_text=text,
            breakpoints=breakpoints,
        )
        return request_id, _with_ideal(submitted, tokens, salt, own=0)

    def _with_ideal(
        submitted: Submitted, whole: list[int], salt: str | None, own: int
    ) -> Submitted:
        """The ideal hit: the best of a block-aligned prefix seen before (any session of
        this salt) and the session's own computed context (token-exact)."""
        if ideal is None:
            return submitted
        hit = max(ideal.hit(whole, salt), min(own, len(whole) - 1))
        return replace(submitted, ideal_cached_tokens=hit, whole_prompt=whole, salt=salt)

    def _with_max_tokens(engine: Engine, total: int) -> SamplingParams:
        max_tokens = resolve_max_tokens(
            requested_max_tokens, total, engine.max_model_len, default_max_tokens
        )
        return replace(params, max_tokens=max_tokens)

    def _add_turn(engine: Engine, spec: SessionSpec) -> tuple[str, Submitted]:
        current = engine.sessions.get(spec.session_id)
        if current is None:  # first use, or first since a restart (restored from disk)
            current = engine.open_session(salt=spec.salt, session_id=spec.session_id)
        if current.active_request is not None:
            raise SessionBusy(
                f"session {spec.session_id} is still running turn {current.active_request}: "
                "wait for it to finish, or fork the session to run turns in parallel"
            )
        history = current.tokens
        conversation = tokenized.conversation
        text = tokenized.text
        full_chat = tokenized.full_chat
        whole = tokenized.tokens
        appending = history and prompt.messages is None
        if appending and not completion_resends_history(spec.mode, whole, spec.opening_tokens):
            appended = tokenized.appended
            if appended is None:  # the session gained its history meanwhile
                assert prompt.text_or_ids is not None
                appended = encode(engine, prompt.text_or_ids, special=False)
            whole = history + appended
        plan = plan_turn(history, whole)
        if not plan.tokens:
            raise InvalidRequest("the prompt is empty")
        check_fits(engine, len(whole))
        final = _with_max_tokens(engine, len(whole))
        if plan.restart:
            log.info(
                "session %s: prompt diverges from the session's %d tokens at token %d; "
                "restarting its trajectory from the common prefix",
                spec.session_id,
                len(history),
                plan.divergence_index,
            )
            turns = current.turns
            engine.close_session(current)
            current = engine.open_session(salt=current.salt, session_id=spec.session_id)
            current.turns = turns
        engine.add_request(
            plan.tokens,
            final,
            request_id=request_id,
            session=current,
            expected_tool_wait_s=spec.expected_tool_wait_s,
            tool=spec.tool,
        )
        submitted = Submitted(
            prompt_tokens=len(whole),
            divergence_index=plan.divergence_index,
            conversation=conversation,
            opening_tokens=whole if (plan.restart or not history) else None,
            prompt_token_ids=list(whole) if keep_prompt_ids else None,
            prompt_text=text,
            breakpoints=tokenized.breakpoints if full_chat else (),
        )
        # Every history token but the last generated one had its KV computed.
        shared = plan.divergence_index if plan.restart else len(history)
        own = min(shared or 0, len(history) - 1)
        return request_id, _with_ideal(submitted, list(whole), current.salt, own)

    return add


def sampling_params(
    *,
    n: int,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    stop: Sequence[str],
    ignore_eos: bool,
) -> SamplingParams:
    """OpenAI defaults (temperature 1, top_p 1); max_tokens is set once the prompt is known."""
    return SamplingParams(
        max_tokens=1,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None or top_k == -1 else top_k,
        seed=seed,
        stop=tuple(stop),
        ignore_eos=ignore_eos,
        n=n,
    )
