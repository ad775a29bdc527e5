"""What the prefix-break classifier compares and what it reports: a request's `PromptView`
(its messages, tools and tokens), and a `PrefixBreak` (where the first divergent token falls,
its `BreakCause`)."""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class BreakCause(enum.StrEnum):
    VOLATILE_AT_HEAD = "volatile_field_at_head"
    VOLATILE = "volatile_field"
    TOOLS_CHANGED = "tool_list_changed"
    REORDERED = "reordered_or_reserialized"
    COMPACTED = "history_compacted"
    INTERLEAVED = "interleaved_conversation"
    EDITED = "history_edited"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Message:
    """One message as the client sent it: its index in the request, role and text."""

    index: int
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class PromptView:
    """A request as the classifier sees it.

    ``system`` is the system prompt's text, ``tools`` each tool as the client serialised it,
    ``messages`` the other messages; all empty for a plain completion prompt or a trace.
    """

    tokens: Sequence[int]
    text: str | None = None
    system: str | None = None
    tools: tuple[str, ...] = ()
    messages: tuple[Message, ...] = ()

    @property
    def structured(self) -> bool:
        return self.system is not None or bool(self.tools) or bool(self.messages)

    @classmethod
    def of_chat(
        cls,
        tokens: Sequence[int],
        text: str | None,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[Any] | None = None,
        system: str | None = None,
    ) -> PromptView:
        """From chat messages (OpenAI shape: system messages first; or ``system`` given)."""
        sys_parts = [] if system is None else [system]
        rest: list[Message] = []
        for i, m in enumerate(messages):
            content = message_text(m.get("content"))
            for extra in ("tool_calls", "tool_call_id", "name"):
                if m.get(extra) is not None:
                    content += "\n" + dump_value(m[extra])
            if m.get("role") in ("system", "developer") and not rest:
                sys_parts.append(content)
            else:
                rest.append(Message(i, str(m.get("role")), content))
        return cls(
            tokens=tokens,
            text=text,
            system="\n".join(sys_parts) if sys_parts else None,
            tools=tuple(dump_value(t) for t in tools or ()),
            messages=tuple(rest),
        )


@dataclass(frozen=True, slots=True)
class BreakLocation:
    """What the first divergent token maps to."""

    field: str  # "system", "tools", "content", "role", "messages" (one was added or
    # removed), "template" (tokens differ, the data does not), "prompt" (no structure)
    message_index: int | None = None
    role: str | None = None
    char_offset: int | None = None  # in the rendered prompt (the new request's)
    before: str = ""  # the characters before the divergence (common to both)
    old: str = ""  # what followed in the previous request
    new: str = ""  # what follows in this one


@dataclass(frozen=True, slots=True)
class PrefixBreak:
    token_index: int  # first divergent token
    previous_tokens: int  # the previous request's prompt length
    location: BreakLocation
    cause: BreakCause
    detail: str
    volatile: dict[str, str] | None = field(default=None)

    @property
    def lost_tokens(self) -> int:
        """Tokens of the previous prompt that can no longer be reused."""
        return self.previous_tokens - self.token_index

    def header(self) -> str:
        """The ``x-kvpilot-prefix-break`` value: ``key=value`` pairs, ASCII, one line."""
        loc = self.location
        parts = [
            f"cause={self.cause}",
            f"token={self.token_index}",
            f"lost={self.lost_tokens}",
            f"field={loc.field}",
        ]
        if loc.message_index is not None:
            parts.append(f"message={loc.message_index}")
        if loc.role is not None:
            parts.append(f"role={loc.role}")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        loc = self.location
        return {
            "cause": str(self.cause),
            "token_index": self.token_index,
            "previous_tokens": self.previous_tokens,
            "lost_tokens": self.lost_tokens,
            "field": loc.field,
            "message_index": loc.message_index,
            "role": loc.role,
            "char_offset": loc.char_offset,
            "context": {"before": loc.before, "old": loc.old, "new": loc.new},
            "volatile": self.volatile,
            "detail": self.detail,
        }


def message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "") if isinstance(part, dict) else str(part) for part in content
        )
    return str(content)


def dump_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
