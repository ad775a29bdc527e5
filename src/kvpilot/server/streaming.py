"""Server-sent events: a request's outputs as OpenAI stream chunks, then ``[DONE]``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvpilot.engine import RequestOutput
from kvpilot.server.protocol import (
    ApiError,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    KvpilotInfo,
    Usage,
)
from kvpilot.server.responses import (
    DISCONNECT_POLL_S,
    Call,
    abort_unfinished,
    finish,
    finish_reason,
    usage_of,
)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(StreamingResponse):
    """A streaming response that always runs ``on_close`` once it ends, however it ends.

    A client can vanish before the first event is sent, when the event generator has not
    started and closing it runs none of its cleanup.
    """

    def __init__(
        self,
        events: AsyncIterator[str],
        on_close: Callable[[], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers=_SSE_HEADERS | (headers or {})
        )
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
            self.on_close()


class Deltas:
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
                out.append((choice.index, delta, finish_reason(choice.finish_reason)))
            elif delta:
                out.append((choice.index, delta, None))
        return out


def sse(model: BaseModel | dict) -> str:
    data = (
        model.model_dump(mode="json", exclude_none=True) if isinstance(model, BaseModel) else model
    )
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def outputs(call: Call) -> AsyncIterator[RequestOutput]:
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


async def events(call: Call) -> AsyncIterator[str]:
    chunk = ChunkMaker(call)
    deltas = Deltas(max((len(s) for s in call.body.stop_list), default=1) - 1)
    try:
        if call.chat:
            for index in range(call.body.n):
                yield sse(chunk([(index, None, None)], role=True))
        async for output in outputs(call):
            if not output.finished:
                for item in deltas.update(output):
                    yield sse(chunk([item]))
                continue
            info = await finish(call, output)
            items = deltas.update(output)
            for item in items[:-1]:
                yield sse(chunk([item]))
            final = chunk(items[-1:], info=info, usage=usage_of(output))
            if not call.body.include_usage:
                final = final.model_copy(update={"usage": None})
            yield sse(final)
            yield "data: [DONE]\n\n"
    except ApiError as exc:
        yield sse(exc.body())
    finally:
        abort_unfinished(call)


class ChunkMaker:
    def __init__(self, call: Call) -> None:
        self.call = call

    def __call__(
        self,
        items: Sequence[tuple[int, str | None, str | None]],
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
