"""A request in flight, and the (non-streamed) response bodies built from its output."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from pydantic import BaseModel

from kvpilot.engine import RequestOutput
from kvpilot.server.async_engine import RequestStream
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
from kvpilot.server.sessions_api import pause_session
from kvpilot.server.state import ServerState
from kvpilot.server.submit import Submitted

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


def abort_unfinished(call: Call) -> None:
    if not call.stream.finished:
        call.state.engine.abort_soon(call.request_id)


async def finish(call: Call, output: RequestOutput) -> KvpilotInfo:
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
        cached_tokens_by_tier=by_tier(output),
        usage=usage_of(output),
        pause=pause,
    )


def by_tier(output: RequestOutput) -> dict[str, int]:
    split = getattr(output, "cached_tokens_by_tier", None)
    if isinstance(split, dict):
        return {"device": 0, "host": 0, "disk": 0} | {str(k): int(v) for k, v in split.items()}
    return {"device": output.cached_tokens, "host": 0, "disk": 0}


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
            usage=info.usage,  # type: ignore[arg-type]
            kvpilot=info.model_copy(update={"usage": None}),
        )
    )


def dump(model: BaseModel) -> dict:
    return model.model_dump(mode="json", exclude_none=False)
