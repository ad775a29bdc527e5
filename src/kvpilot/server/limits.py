"""Server limits, each refused with a 4xx that says which limit and how to stay under it."""

from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpilot.errors import ConfigError, PromptTooLong
from kvpilot.server.protocol import ApiError, error_body


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_tokens_limit: int = 4096  # largest max_tokens a request may ask for
    max_n: int = 8
    max_sessions_per_tenant: int = 256
    max_body_bytes: int = 4 << 20
    session_ttl_s: float = 3600.0  # sessions idle this long expire (--session-ttl)

    def __post_init__(self) -> None:
        for name in ("max_tokens_limit", "max_n", "max_sessions_per_tenant", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.session_ttl_s <= 30 * 86400:
            raise ConfigError(
                f"--session-ttl must be in (0, 30 days] seconds, got {self.session_ttl_s}"
            )

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise ApiError(400, f"n={n} exceeds this server's limit of {self.max_n}", param="n")

    def check_max_tokens(self, max_tokens: int | None, param: str = "max_tokens") -> None:
        if max_tokens is not None and max_tokens > self.max_tokens_limit:
            raise ApiError(
                400,
                f"{param}={max_tokens} exceeds this server's limit of {self.max_tokens_limit}",
                param=param,
            )


def resolve_max_tokens(
    requested: int | None, prompt_tokens: int, max_model_len: int, default: int
) -> int:
    """max_tokens for a prompt of ``prompt_tokens`` (history included) in a context window.

    An explicit value that does not fit is refused; the default is clipped to what fits.
    """
    room = max_model_len - prompt_tokens
    if requested is None:
        return max(1, min(default, room))
    if requested > room:
        raise PromptTooLong(
            f"prompt of {prompt_tokens} tokens plus max_tokens={requested} exceeds the model "
            f"context of {max_model_len} tokens: lower max_tokens to at most {max(room, 0)} "
            "or shorten the prompt"
        )
    return requested


class BodySizeLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with 413, before parsing.

    The body is read here (it is bounded) and replayed to the app, so the limit holds for
    chunked uploads that declare no length.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            error_body(
                f"request body exceeds this server's limit of {self.max_bytes} bytes "
                "(--max-body-bytes)",
                "invalid_request_error",
                code="request_too_large",
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
