"""The wire format: OpenAI-compatible request and response bodies, plus kvpilot's extensions.

Extensions ride along as extra body fields (``extra_body`` in the OpenAI client):
``session_id``, ``session_history``, ``expected_tool_wait_s``, ``tool``, ``cache_salt``,
``top_k``, ``ignore_eos``, ``return_token_ids``; OpenAI's ``prompt_cache_key`` and
``prompt_cache_retention`` are honoured. Responses carry a ``kvpilot`` object
(session, prompt divergence, per-tier cached tokens, the pause decision taken when the turn
ended, token ids when asked for) next to the standard fields.
Types are strict: ``"5"`` is not a number and ``true`` is not a token id.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from kvpilot.policy.pause_inputs import MAX_WAIT_S

# Session ids: the client's own (created on first use) or the server's; scoped per tenant.
SESSION_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"

ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "not_found_error",
    "conflict_error",
    "rate_limit_error",
    "not_implemented_error",
    "server_error",
]


class ApiError(Exception):
    """An error answered with an HTTP status and the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: ErrorType = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- requests ------------------------------------------------------------------------------


def check_text(data: Any, where: str = "body") -> Any:
    """``data`` unchanged, or ValueError (a 400) if a string in it is not valid Unicode text:
    JSON may escape lone surrogates (``"\\ud800"``), which no tokenizer can encode."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{where} holds a lone surrogate at character {exc.start}: text must be valid "
                "Unicode (a UTF-16 surrogate escape must come in a high-low pair)"
            ) from None
    elif isinstance(data, dict):
        for key, value in data.items():
            check_text(key, where)
            check_text(value, f"{where}.{key}" if isinstance(key, str) else where)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            check_text(value, f"{where}[{i}]")
    return data


class RequestBody(BaseModel):
    """A request body: every string in it must be valid Unicode text."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        return check_text(data, "body")


SessionHistory = Literal["auto", "full", "append"]

# Fields of the OpenAI API kvpilot does not implement, with the values that mean "unused".
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class GenerationRequest(RequestBody):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)
    n: StrictInt = Field(1, ge=1)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    user: StrictStr | None = None
    session_id: StrictStr | None = Field(None, pattern=SESSION_ID_PATTERN)
    session_history: SessionHistory = "auto"
    # A session_id names the caller's session, created on first use; with False a missing
    # session is a 404 instead (a router that must know when a replica lost one).
    session_create: StrictBool = True
    expected_tool_wait_s: StrictFloat | None = Field(
        None, ge=0.0, le=MAX_WAIT_S, allow_inf_nan=False
    )
    tool: StrictStr | None = Field(None, max_length=256)
    cache_salt: StrictStr | None = Field(None, min_length=1, max_length=256)
    return_token_ids: StrictBool = False
    # OpenAI prompt caching: a key grouping requests that share a prefix (prefix breaks are
    # reported per group), and how long the prefix is kept ("24h": pinned for a day).
    prompt_cache_key: StrictStr | None = Field(None, min_length=1, max_length=256)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None

    @property
    def pause_hint(self) -> bool:
        """The turn ends on a tool call: pause the session when it finishes."""
        return self.expected_tool_wait_s is not None or self.tool is not None

    def unsupported_fields(self) -> list[str]:
        extra = self.model_extra or {}
        return [
            name
            for name, unused in UNSUPPORTED_FIELDS.items()
            if name in extra and extra[name] not in unused
        ]

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


Prompt = StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]


class CompletionRequest(GenerationRequest):
    prompt: Prompt

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a batch of several is refused, not guessed at)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ApiError(
                    400,
                    f"prompt holds {len(prompt)} prompts; send one prompt per request",
                    param="prompt",
                )
            return prompt[0]
        return prompt  # type: ignore[return-value]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One message; extra fields (name, tool_calls, tool_call_id) pass through to the template."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = dict(self.model_extra or {})
        message["role"] = "system" if self.role == "developer" else self.role
        message["content"] = content or ""
        return message


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


class CreateSessionRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")
    cache_salt: StrictStr | None = Field(None, min_length=1, max_length=256)
    session_id: StrictStr | None = Field(None, pattern=SESSION_ID_PATTERN)  # yours, or made up


class ForkSessionRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")
    n: StrictInt = Field(1, ge=1)


class PauseSessionRequest(RequestBody):
    """Without ``expected_wait_s`` the engine predicts the wait from the tool's past waits."""

    model_config = ConfigDict(extra="forbid")
    expected_wait_s: StrictFloat | None = Field(None, ge=0.0, le=MAX_WAIT_S, allow_inf_nan=False)
    tool: StrictStr | None = Field(None, max_length=256)


# -- responses -----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class KvpilotInfo(BaseModel):
    """The ``kvpilot`` extension object of a response (and of a stream's final chunk)."""

    session_id: str | None = None
    prompt_divergence_index: int | None = None
    cached_tokens_by_tier: dict[str, int]
    usage: Usage | None = None
    pause: dict[str, Any] | None = None
    prefix_break: dict[str, Any] | None = None  # why the prompt diverged from the previous
    prompt_cache: dict[str, Any] | None = None  # usage split as billed, pinned breakpoints
    prompt_token_ids: list[int] | None = None  # the whole prompt (history included)
    completion_token_ids: list[list[int]] | None = None  # per choice


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kvpilot: KvpilotInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kvpilot: KvpilotInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    kvpilot: KvpilotInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvpilot"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
