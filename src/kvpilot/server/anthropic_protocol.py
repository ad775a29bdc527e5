"""Anthropic's Messages API on the wire, translated to and from kvpilot's one request model.

A ``POST /v1/messages`` body becomes the same `ChatCompletionRequest` the OpenAI routes use
(system prompt, tools and messages through the model's chat template; ``stop_sequences`` ->
``stop``; ``metadata.user_id`` -> ``user``; kvpilot's ``session_id`` /
``expected_tool_wait_s`` / ``tool`` extras as they are), plus its cache breakpoints: each
``cache_control`` on a tool, a system block or a message content block becomes a
`BreakpointSpec`, the request cut right after that block. Content blocks become text for
the template: text as is, ``tool_use`` and ``tool_result`` as JSON.

Errors leave in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

from kvpilot.policy.pause_inputs import MAX_WAIT_S
from kvpilot.server.protocol import (
    SESSION_ID_PATTERN,
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    RequestBody,
)
from kvpilot.server.submit import BreakpointSpec

MAX_BREAKPOINTS = 4
TTLS_S = {"5m": 300.0, "1h": 3600.0}
ANTHROPIC_PREFIXES = ("/v1/messages",)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def is_anthropic_route(path: str) -> bool:
    return path.startswith(ANTHROPIC_PREFIXES)


def anthropic_error_body(status: int, openai_body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI error body in Anthropic's shape."""
    error = openai_body.get("error", {})
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.get("message", "")}}


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class ContentBlock(BaseModel):
    """text, tool_use or tool_result (images and documents are refused)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "tool_use", "tool_result"]
    text: StrictStr | None = None
    id: StrictStr | None = None
    name: StrictStr | None = None
    input: dict[str, Any] | None = None
    tool_use_id: StrictStr | None = None
    content: StrictStr | list[dict[str, Any]] | None = None
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None

    def as_text(self) -> str:
        if self.type == "text":
            return self.text or ""
        if self.type == "tool_use":
            return json.dumps(
                {"type": "tool_use", "id": self.id, "name": self.name, "input": self.input or {}},
                ensure_ascii=False,
            )
        content = self.content
        if isinstance(content, list):
            content = "".join(str(part.get("text", "")) for part in content)
        return json.dumps(
            {"type": "tool_result", "tool_use_id": self.tool_use_id, "content": content or ""},
            ensure_ascii=False,
        )


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: StrictStr | list[ContentBlock]

    def blocks(self) -> list[ContentBlock]:
        if isinstance(self.content, str):
            return [ContentBlock(type="text", text=self.content)]
        return self.content

    def template_message(self, upto: int | None = None) -> dict[str, Any]:
        blocks = self.blocks()[: None if upto is None else upto + 1]
        only_results = bool(blocks) and all(b.type == "tool_result" for b in blocks)
        role = "tool" if only_results else self.role
        return {"role": role, "content": "".join(b.as_text() for b in blocks)}


class SystemBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)
    cache_control: CacheControl | None = None

    def as_function(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.input_schema
        return {"type": "function", "function": fn}


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: StrictStr | None = None


class MessagesRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    max_tokens: StrictInt = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: StrictStr | list[SystemBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0)
    stream: StrictBool = False
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None  # a breakpoint on the last block
    # kvpilot's extras, as on the OpenAI routes
    session_id: StrictStr | None = Field(None, pattern=SESSION_ID_PATTERN)
    expected_tool_wait_s: StrictFloat | None = Field(
        None, ge=0.0, le=MAX_WAIT_S, allow_inf_nan=False
    )
    tool: StrictStr | None = Field(None, max_length=256)
    prompt_cache_key: StrictStr | None = Field(None, min_length=1, max_length=256)

    def system_blocks(self) -> list[SystemBlock]:
        if self.system is None:
            return []
        if isinstance(self.system, str):
            return [SystemBlock(type="text", text=self.system)]
        return self.system

    def template_messages(self) -> list[dict[str, Any]]:
        system = self.system_blocks()
        out = [{"role": "system", "content": _join(system)}] if system else []
        return out + [m.template_message() for m in self.messages]

    def function_tools(self) -> list[dict[str, Any]] | None:
        return [t.as_function() for t in self.tools] if self.tools else None

    def to_chat_request(self) -> ChatCompletionRequest:
        """The one internal request model (the OpenAI routes' `ChatCompletionRequest`)."""
        return ChatCompletionRequest(
            model=self.model,
            messages=[ChatMessage(**m) for m in self.template_messages()],
            tools=self.function_tools(),
            max_tokens=self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop_sequences or None,
            stream=self.stream,
            user=self.metadata.user_id if self.metadata else None,
            session_id=self.session_id,
            session_history="full",  # Anthropic clients always send the whole conversation
            expected_tool_wait_s=self.expected_tool_wait_s,
            tool=self.tool,
            prompt_cache_key=self.prompt_cache_key,
        )

    def breakpoints(self) -> tuple[BreakpointSpec, ...]:
        """Every ``cache_control``, in prompt order (tools, system, messages): the request
        cut after the marked block. At most 4, longer TTLs first (400 otherwise)."""
        tools = self.tools or []
        system = self.system_blocks()
        marks: list[BreakpointSpec] = []
        for i, t in enumerate(tools):
            if t.cache_control is not None:
                cut = [x.as_function() for x in tools[: i + 1]]
                marks.append(BreakpointSpec([], cut, TTLS_S[t.cache_control.ttl], f"tools[{i}]"))
        all_tools = self.function_tools()
        for i, b in enumerate(system):
            if b.cache_control is not None:
                msgs = [{"role": "system", "content": _join(system[: i + 1])}]
                marks.append(
                    BreakpointSpec(msgs, all_tools, TTLS_S[b.cache_control.ttl], f"system[{i}]")
                )
        head = [{"role": "system", "content": _join(system)}] if system else []
        for i, m in enumerate(self.messages):
            for j, block in enumerate(m.blocks()):
                if block.cache_control is None:
                    continue
                msgs = [*head, *(x.template_message() for x in self.messages[:i])]
                msgs.append(m.template_message(upto=j))
                where = f"messages[{i}].content[{j}]"
                ttl_s = TTLS_S[block.cache_control.ttl]
                marks.append(BreakpointSpec(msgs, all_tools, ttl_s, where))
        if self.cache_control is not None:  # the last block of the last message
            i = len(self.messages) - 1
            blocks = self.messages[i].blocks()
            if not blocks:
                raise ApiError(
                    400,
                    "cache_control marks the last content block, but the last message has none",
                    param="cache_control",
                )
            if blocks[-1].cache_control is None:
                msgs = [*head, *(x.template_message() for x in self.messages)]
                marks.append(
                    BreakpointSpec(msgs, all_tools, TTLS_S[self.cache_control.ttl], "cache_control")
                )
        if len(marks) > MAX_BREAKPOINTS:
            raise ApiError(
                400,
                f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                f"Found {len(marks)}.",
            )
        for earlier, later in itertools.pairwise(marks):
            if later.ttl_s > earlier.ttl_s:
                raise ApiError(
                    400,
                    f"cache_control ttl '1h' at {later.where} comes after ttl '5m' at "
                    f"{earlier.where}: a breakpoint with a longer ttl must come before those "
                    "with a shorter one (tools, then system, then messages)",
                )
        return tuple(marks)


def _join(blocks: list[SystemBlock]) -> str:
    return "\n".join(b.text for b in blocks)


# -- responses -----------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def stop_reason(finish: str | None, stop_sequence: str | None) -> StopReason:
    if finish == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def usage_body(
    input_tokens: int,
    read: int,
    written_by_ttl: dict[float, int],
    output_tokens: int,
) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "cache_creation_input_tokens": sum(written_by_ttl.values()),
        "cache_read_input_tokens": read,
        "cache_creation": {
            "ephemeral_5m_input_tokens": sum(n for t, n in written_by_ttl.items() if t <= 300),
            "ephemeral_1h_input_tokens": sum(n for t, n in written_by_ttl.items() if t > 300),
        },
        "output_tokens": output_tokens,
        "service_tier": "standard",
    }
