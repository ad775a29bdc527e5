"""A request's usage, split the way a provider bills it, from what the engine did.

    prompt:   |--- read from cache ---|--- written at breakpoints ---|--- input ---|
              0                     read                            last new pin    n

``cache_read_input_tokens`` are the tokens the engine reused; ``cache_creation_input_tokens``
the tokens computed by this request and pinned at its breakpoints (each span attributed to
the TTL of the breakpoint that ends it); ``input_tokens`` the rest, computed and not pinned.
The three add up to the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.errors import InvalidRequest
from kvpilot.promptcache.ledger import RequestUsage


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """A ``cache_control`` mark: the prompt prefix up to ``position`` tokens, for ``ttl_s``."""

    position: int
    ttl_s: float
    where: str = ""  # "tools[1]", "system[0]", "messages[3].content[0]": for messages


def check_ttl_order(breakpoints: Sequence[Breakpoint]) -> None:
    """Longer TTLs must come before shorter ones (the provider's rule; 400 otherwise)."""
    longest_after = 0.0
    for bp in reversed(breakpoints):
        if bp.ttl_s < longest_after:
            later = next(b for b in reversed(breakpoints) if b.ttl_s == longest_after)
            raise InvalidRequest(
                f"a cache_control breakpoint with a longer ttl ({later.where}) comes after one "
                f"with a shorter ttl ({bp.where}): breakpoints with ttl '1h' must come before "
                "those with ttl '5m'"
            )
        longest_after = max(longest_after, bp.ttl_s)


def cacheable(
    breakpoints: Sequence[Breakpoint], block_size: int, min_tokens: int
) -> list[tuple[int, float]]:
    """Block-aligned (position, ttl) of the breakpoints long enough to cache, one per
    position (the longest TTL), in order."""
    out: dict[int, float] = {}
    for bp in breakpoints:
        if bp.position < max(min_tokens, block_size):
            continue
        p = bp.position // block_size * block_size
        out[p] = max(out.get(p, 0.0), bp.ttl_s)
    return sorted(out.items())


def split_usage(
    prompt_tokens: int,
    read_tokens: int,
    pinned: Sequence[tuple[int, float]],
    created: Sequence[tuple[int, float]],
    output_tokens: int,
) -> RequestUsage:
    """``pinned``: every breakpoint position pinned after this request (new or refreshed);
    ``created``: the new ones. Each new pin is billed for what it adds past ``read_tokens``
    and past the pin before it."""
    new = set(created)
    writes: dict[float, int] = {}
    lo = read_tokens
    for p, ttl in sorted(pinned):
        if p > lo and (p, ttl) in new:
            writes[ttl] = writes.get(ttl, 0) + p - lo
        lo = max(lo, p)
    written = sum(writes.values())
    return RequestUsage(
        input_tokens=prompt_tokens - read_tokens - written,
        cached_read_tokens=read_tokens,
        output_tokens=output_tokens,
        cache_write_tokens_by_ttl=writes,
    )
