"""Why a prompt stopped matching its predecessor: the prefix-break classifier.

Attention state for a token depends on every token before it, so the cache serves a request
only up to the first token where it differs from what was sent before. When a request of a
session (or of a ``prompt_cache_key`` group) diverges from the previous request *before the
end of that request's prompt*, everything after the divergence is prefilled again. This
module says where (token, message, field, the characters around it) and why:

=============================  ==========================================================
cause                          signature
=============================  ==========================================================
``volatile_field_at_head``     one short value (timestamp, UUID, counter) differs in the
                               system prompt, the tools or the first message
``volatile_field``             the same, further down the history
``tool_list_changed``          tools added, removed or changed
``reordered_or_reserialized``  the same tools or messages in another order, or the same
                               data serialised differently (JSON key order, whitespace)
``history_compacted``          history after the head removed or replaced (summaries,
                               dropped turns, truncation)
``interleaved_conversation``   another conversation in the same session: a different head
                               (an orchestrator and its sub-agents, a user simulator and
                               an agent), or a return to an earlier conversation
``history_edited``             a message of the history changed in place
``unknown``                    no structure to tell (a token-only trace)
=============================  ==========================================================

The classifier is pure: it compares two `PromptView` s (structured messages and tools when
the request had them, the rendered text when known, the token ids always). Interleaving
across more than two requests is recognised by `kvpilot.promptcache.conversations`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvpilot.promptcache.prompt_view import (
    BreakCause,
    BreakLocation,
    Message,
    PrefixBreak,
    PromptView,
)
from kvpilot.promptcache.volatile import (
    common_prefix_chars,
    find_volatile_field,
    find_volatile_in_prompt,
)

CONTEXT_CHARS = 24  # characters shown on each side of the divergence
HEAD_FRACTION = 0.1  # without structure, the first 10% of a prompt counts as its head

__all__ = [
    "BreakCause",
    "BreakLocation",
    "Message",
    "PrefixBreak",
    "PromptView",
    "classify_break",
    "common_prefix_len",
]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (bisection over slice compares)."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[lo:mid]) == list(b[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def classify_break(prev: PromptView, new: PromptView) -> PrefixBreak | None:
    """The break between consecutive requests, or None if ``new`` extends ``prev``'s prompt."""
    k = common_prefix_len(prev.tokens, new.tokens)
    if k >= len(prev.tokens):
        return None
    if prev.structured and new.structured:
        if _extends_last_message(prev, new):
            return None
        return _structured(prev, new, k)
    return _unstructured(prev, new, k)


# -- requests with messages and tools ------------------------------------------------------


def _structured(prev: PromptView, new: PromptView, k: int) -> PrefixBreak:
    loc = _context(prev, new)
    if prev.system != new.system:
        where = replace_loc(loc, field="system", role="system")
        return _field_change(prev, new, k, where, prev.system or "", new.system or "", head=True)
    if prev.tools != new.tools:
        where = replace_loc(loc, field="tools")
        if sorted(map(_canonical, prev.tools)) == sorted(map(_canonical, new.tools)):
            same_order = list(map(_canonical, prev.tools)) == list(map(_canonical, new.tools))
            what = "serialised differently" if same_order else "reordered"
            return _break(k, prev, where, BreakCause.REORDERED, f"the same tools, {what}")
        added = set(map(_tool_name, new.tools)) - set(map(_tool_name, prev.tools))
        removed = set(map(_tool_name, prev.tools)) - set(map(_tool_name, new.tools))
        detail = "the tool list changed mid-trajectory"
        if added or removed:
            detail += f" (added: {sorted(added) or '-'}, removed: {sorted(removed) or '-'})"
        return _break(k, prev, where, BreakCause.TOOLS_CHANGED, detail)
    i = _first_differing_message(prev.messages, new.messages)
    if i is None:
        where = replace_loc(loc, field="template")
        return _break(
            k,
            prev,
            where,
            BreakCause.REORDERED,
            "same messages and tools, different tokens: the prompt was re-serialised "
            "(chat template or tokenization)",
        )
    if i >= len(new.messages) or i >= len(prev.messages):
        shorter = i >= len(new.messages)
        m = prev.messages[i] if shorter else new.messages[i]
        where = replace_loc(loc, field="messages", message_index=m.index, role=m.role)
        if shorter:
            return _break(
                k, prev, where, BreakCause.COMPACTED, f"history truncated after message {i}"
            )
        return _break(k, prev, where, BreakCause.EDITED, "a message was inserted")
    old_m, new_m = prev.messages[i], new.messages[i]
    head = i == 0
    if old_m.role != new_m.role:
        where = replace_loc(loc, field="role", message_index=new_m.index, role=new_m.role)
    else:
        where = replace_loc(loc, field="content", message_index=new_m.index, role=new_m.role)
    rest_old, rest_new = prev.messages[i:], new.messages[i:]
    if _canonical(old_m.content) == _canonical(new_m.content) and old_m.role == new_m.role:
        return _break(k, prev, where, BreakCause.REORDERED, f"message {new_m.index} re-serialised")
    if head:
        return _field_change(prev, new, k, where, old_m.content, new_m.content, head=True)
    volatile = find_volatile_field(old_m.content, new_m.content)
    if volatile is not None:
        return _volatile(k, prev, where, volatile, head=False)
    if Counter(_key(m) for m in rest_old) <= Counter(_key(m) for m in rest_new):
        return _break(k, prev, where, BreakCause.REORDERED, "the same messages, reordered")
    edited_in_place = [_key(m) for m in rest_new[1 : len(rest_old)]] == [
        _key(m) for m in rest_old[1:]
    ]
    if not edited_in_place and (
        len(new.messages) < len(prev.messages) or _keeps_tail(rest_old, rest_new)
    ):
        return _break(
            k,
            prev,
            where,
            BreakCause.COMPACTED,
            f"history from message {new_m.index} on was compacted "
            f"({len(prev.messages)} -> {len(new.messages)} messages)",
        )
    return _break(k, prev, where, BreakCause.EDITED, f"message {new_m.index} was edited")


def _extends_last_message(prev: PromptView, new: PromptView) -> bool:
    """``new`` only appends to the content of ``prev``'s last message (and may add messages
    after it): everything sent before is resent, only the template's end-of-message and
    generation-prompt tokens after the old content are not reused."""
    if (prev.system, prev.tools) != (new.system, new.tools) or not prev.messages:
        return False
    n = len(prev.messages)
    if len(new.messages) < n or prev.messages[: n - 1] != new.messages[: n - 1]:
        return False
    old, cur = prev.messages[-1], new.messages[n - 1]
    return old.role == cur.role and cur.content.startswith(old.content)


def _field_change(
    prev: PromptView,
    new: PromptView,
    k: int,
    where: BreakLocation,
    old: str,
    new_text: str,
    *,
    head: bool,
) -> PrefixBreak:
    """A change at the head (system prompt or first message): a volatile field, or a
    different head altogether, which is another conversation."""
    volatile = find_volatile_field(old, new_text)
    if volatile is not None:
        return _volatile(k, prev, where, volatile, head=head)
    if _canonical(old) == _canonical(new_text):
        return _break(k, prev, where, BreakCause.REORDERED, f"the {where.field} re-serialised")
    return _break(
        k,
        prev,
        where,
        BreakCause.INTERLEAVED,
        f"a different {'system prompt' if where.field == 'system' else 'first message'}: "
        "another conversation in the same session",
    )


def _volatile(k: int, prev: PromptView, where: BreakLocation, v: Any, *, head: bool) -> PrefixBreak:
    cause = BreakCause.VOLATILE_AT_HEAD if head else BreakCause.VOLATILE
    place = "at the head" if head else "in the history"
    return _break(
        k,
        prev,
        where,
        cause,
        f"a per-call {v.kind} {place} ({v.old!r} -> {v.new!r}): move it after the stable "
        "part of the prompt",
        volatile={"kind": v.kind, "old": v.old, "new": v.new},
    )


def _first_differing_message(a: Sequence[Message], b: Sequence[Message]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if (x.role, x.content) != (y.role, y.content):
            return i
    if len(a) > len(b):
        return len(b)
    return None  # b extends a: the tokens differ while the data does not


def _keeps_tail(old: Sequence[Message], new: Sequence[Message]) -> bool:
    """``new`` keeps the last message of ``old`` after dropping or summarising others."""
    last = _key(old[-1])
    return any(_key(m) == last for m in new)


# -- token-only or text-only requests ------------------------------------------------------


def _unstructured(prev: PromptView, new: PromptView, k: int) -> PrefixBreak:
    loc = replace_loc(_context(prev, new), field="prompt")
    head = k < max(1, int(len(prev.tokens) * HEAD_FRACTION))
    if prev.text is not None and new.text is not None:
        volatile = find_volatile_in_prompt(prev.text, new.text)
        if volatile is not None:
            return _volatile(k, prev, loc, volatile, head=head)
    elif _short_token_change(prev.tokens, new.tokens, k):
        return _break(
            k,
            prev,
            loc,
            BreakCause.VOLATILE_AT_HEAD if head else BreakCause.VOLATILE,
            "a few tokens changed and the rest of the prompt follows unchanged: a per-call "
            "field (no text to tell which)",
        )
    if len(new.tokens) < len(prev.tokens) and _shares_suffix(prev.tokens, new.tokens):
        return _break(k, prev, loc, BreakCause.COMPACTED, "the prompt shrank and kept its end")
    has_text = prev.text is not None and new.text is not None
    if head and (has_text or len(new.tokens) < len(prev.tokens)):
        # With text: the head changed by more than a value. Tokens only: a new conversation
        # starts short, while a continuation with a changed head has grown.
        return _break(
            k,
            prev,
            loc,
            BreakCause.INTERLEAVED,
            f"the prompts share only {k} tokens: another conversation in the same session",
        )
    where = "at the head" if head else "before its end"
    return _break(k, prev, loc, BreakCause.UNKNOWN, f"the prompt changed {where}")


def _short_token_change(
    a: Sequence[int], b: Sequence[int], k: int, max_tokens: int = 16, sync: int = 8
) -> bool:
    """After a change of at most ``max_tokens`` tokens at ``k``, ``b`` goes on as ``a`` did."""
    for x in range(max_tokens + 1):
        anchor = list(a[k + x : k + x + sync])
        if len(anchor) < sync:
            return False
        for y in range(max(0, x - max_tokens), x + max_tokens + 1):
            if list(b[k + y : k + y + sync]) == anchor:
                return True
    return False


def _shares_suffix(a: Sequence[int], b: Sequence[int], min_tokens: int = 16) -> bool:
    n = min(len(a), len(b), 64)
    return n >= min_tokens and list(a[-n:]) == list(b[-n:])


# -- helpers -------------------------------------------------------------------------------


def replace_loc(loc: BreakLocation, **changes: Any) -> BreakLocation:
    fields = {name: getattr(loc, name) for name in BreakLocation.__dataclass_fields__}
    return BreakLocation(**(fields | changes))


def _context(prev: PromptView, new: PromptView) -> BreakLocation:
    if prev.text is None or new.text is None:
        return BreakLocation(field="prompt")
    c = common_prefix_chars(prev.text, new.text)
    return BreakLocation(
        field="prompt",
        char_offset=c,
        before=prev.text[max(0, c - CONTEXT_CHARS) : c],
        old=prev.text[c : c + CONTEXT_CHARS],
        new=new.text[c : c + CONTEXT_CHARS],
    )


def _break(
    k: int,
    prev: PromptView,
    where: BreakLocation,
    cause: BreakCause,
    detail: str,
    volatile: dict[str, str] | None = None,
) -> PrefixBreak:
    return PrefixBreak(k, len(prev.tokens), where, cause, detail, volatile)


def _canonical(text: str) -> str:
    """The same data however it was serialised: JSON with sorted keys, or collapsed spaces."""
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except (ValueError, TypeError):
        return " ".join(text.split())


def _key(m: Message) -> tuple[str, str]:
    return m.role, _canonical(m.content)


def _tool_name(tool: str) -> str:
    try:
        data = json.loads(tool)
    except (ValueError, TypeError):
        return tool[:40]
    if isinstance(data, dict):
        fn = data.get("function")
        name = fn.get("name") if isinstance(fn, dict) else data.get("name")
        if isinstance(name, str):
            return name
    return tool[:40]
