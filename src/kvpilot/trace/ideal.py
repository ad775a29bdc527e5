"""The ideal (infinite-cache) prefix hit of a sequence of calls.

Call i hits the longest block-aligned prefix it shares with any earlier call, leaving at
least one token to compute, exactly as the engine's radix cache would with unlimited
memory. Blocks are compared by the memory core's chained block hash.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.memory.hashing import chain_hashes


def ideal_hits(calls: Sequence[Sequence[int]], block_size: int) -> list[int]:
    seen: set[bytes] = set()
    hits: list[int] = []
    for tokens in calls:
        hashes = chain_hashes(tokens, block_size)
        usable = (len(tokens) - 1) // block_size
        n = 0
        while n < usable and hashes[n] in seen:
            n += 1
        hits.append(n * block_size)
        seen.update(hashes)
    return hits


def ideal_hit_rate(calls: Sequence[Sequence[int]], block_size: int) -> float:
    total = sum(len(c) for c in calls)
    return sum(ideal_hits(calls, block_size)) / total if total else 0.0
