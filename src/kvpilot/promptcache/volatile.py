"""Is a difference between two texts a volatile field (a timestamp, an id, a counter)?

A per-call field is the commonest reason a prompt stops matching its predecessor: a date in
the system prompt, a request id, a turn counter. Seen from two consecutive prompts it is a
short stretch that differs while everything around it is equal, and the differing stretch
looks like a value rather than like words:

    "Today is 2025-06-01 10:31:07. You are ..."
    "Today is 2025-06-01 10:31:52. You are ..."
                         ^^^^^^^^ (middle)     common prefix / common suffix around it
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The differing middle is widened to whole "value" characters on both sides, so a timestamp
# that differs only in its seconds is seen whole ("10:31:07", not "07").
_VALUE_CHARS = re.compile(r"[0-9A-Za-z:.\-_+/TZ]")
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "uuid",
        re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"),
    ),
    (
        "timestamp",
        re.compile(
            r"\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?)?"
            r"|\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?"
            r"|1\d{9}(\d{3}){0,2}"  # epoch seconds, milliseconds, microseconds
        ),
    ),
    ("hex_id", re.compile(r"(?=[0-9a-fA-F_-]*\d)[0-9a-fA-F_-]{8,}")),
    ("counter", re.compile(r"\d+")),
)
_SEPARATORS = re.compile(r"([^0-9A-Za-z:.\-_+/]+)")
_TRAILING = ".:-_/+"  # sentence punctuation after a value is not part of it
MAX_VALUE_CHARS = 48  # a longer differing stretch is content, not a field


@dataclass(frozen=True, slots=True)
class VolatileField:
    kind: str  # "uuid", "timestamp", "hex_id", "counter"
    old: str
    new: str
    offset: int  # where the value starts, in both texts (they are equal before it)


def common_prefix_chars(a: str, b: str) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:  # binary search on prefix equality: O(n log n) compares in C
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_suffix_chars(a: str, b: str, limit: int) -> int:
    n = min(len(a), len(b), limit)
    k = 0
    while k < n and a[-1 - k] == b[-1 - k]:
        k += 1
    return k


def _widen(text: str, start: int, end: int) -> tuple[int, int]:
    while start > 0 and _VALUE_CHARS.match(text[start - 1]):
        start -= 1
    while end < len(text) and _VALUE_CHARS.match(text[end]):
        end += 1
    return start, end


def _expand(old: str, new: str, head: int, tail: int) -> tuple[int, int, int]:
    """Start, and ends in ``old`` and ``new``, of the differing stretch widened to values."""
    start_old, end_old = _widen(old, head, len(old) - tail)
    start_new, end_new = _widen(new, head, len(new) - tail)
    return min(start_old, start_new), end_old, end_new


def _kind(value: str) -> str | None:
    for kind, pattern in _PATTERNS:
        if pattern.fullmatch(value):
            return kind
    return None


def find_volatile_field(
    old: str, new: str, max_chars: int = MAX_VALUE_CHARS
) -> VolatileField | None:
    """The one short value that differs between ``old`` and ``new``, or None.

    None when the texts are equal, differ in more than one place, or differ in a stretch
    that is long or does not look like a value.
    """
    if old == new:
        return None
    head = common_prefix_chars(old, new)
    tail = common_suffix_chars(old, new, min(len(old), len(new)) - head)
    start, end_old, end_new = _expand(old, new, head, tail)
    a, b = old[start:end_old].rstrip(_TRAILING), new[start:end_new].rstrip(_TRAILING)
    start_old = start
    if not a or not b or len(a) > max_chars or len(b) > max_chars:
        return None
    kind = _pair_kind(a, b)
    if kind is None:
        # Several values in a short stretch ("[request 0003 at 2025-01-04]"): the same
        # separators, and every piece that differs is a value.
        pieces_a, pieces_b = _SEPARATORS.split(a), _SEPARATORS.split(b)
        if len(pieces_a) != len(pieces_b) or pieces_a[1::2] != pieces_b[1::2]:
            return None
        kinds = [_pair_kind(x, y) for x, y in zip(pieces_a[::2], pieces_b[::2], strict=True)]
        differing = [
            k for k, x, y in zip(kinds, pieces_a[::2], pieces_b[::2], strict=True) if x != y
        ]
        if not differing or differing[0] is None or None in differing:
            return None
        kind = differing[0]
    return VolatileField(kind, a, b, start_old)


def _pair_kind(a: str, b: str) -> str | None:
    kind_a, kind_b = _kind(a), _kind(b)
    if kind_a is None or kind_b is None:
        return None
    if kind_a == kind_b:
        return kind_a
    return "timestamp" if "timestamp" in (kind_a, kind_b) else kind_a


def find_volatile_in_prompt(
    old: str, new: str, max_chars: int = MAX_VALUE_CHARS, sync_chars: int = 24
) -> VolatileField | None:
    """A volatile field where ``new`` first differs from ``old``, when ``new`` may also go on
    past ``old``'s end (a whole prompt that grew): the texts must fall back in step within
    ``max_chars`` after the difference, for ``sync_chars`` characters."""
    head = common_prefix_chars(old, new)
    for x in range(max_chars + 1):
        anchor = old[head + x : head + x + sync_chars]
        if len(anchor) < min(sync_chars, len(old) - head - x) or not anchor:
            break
        lo = max(head, head + x - max_chars)
        at = new.find(anchor, lo, head + x + max_chars + sync_chars)
        if at >= 0:
            end_old, end_new = head + x + len(anchor), at + len(anchor)
            return find_volatile_field(old[:end_old], new[:end_new], max_chars)
    return None
