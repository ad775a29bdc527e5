"""The ideal (infinite-cache) prefix hit of a sequence of calls.

Call i hits the longest block-aligned prefix it shares with any earlier call, leaving at
least one token to compute, exactly as the engine's radix cache would with unlimited
memory. Blocks are compared by the memory core's chained block hash.
"""

from __future__ import annotations

import threading
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


class IdealHitMeter:
    """`ideal_hits` one call at a time, for a live server (`kvpilot_ideal_cached_prompt_tokens`).

    Remembers the chained hashes of every full block it was shown, per salt (so tenants
    never share, as in the engine), forgetting the oldest past ``max_blocks`` (the default
    keeps about 4M distinct tokens of context in about 25 MB). `hit` and `add` may run on
    different threads.
    """

    def __init__(self, block_size: int, max_blocks: int = 1 << 18) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._seen: dict[bytes, None] = {}  # insertion order: oldest first
        self._lock = threading.Lock()

    def hit(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """Tokens of ``tokens`` an unbounded cache would serve: the longest block-aligned
        prefix seen before, leaving at least one token to compute."""
        usable = (len(tokens) - 1) // self.block_size
        hashes = chain_hashes(tokens[: usable * self.block_size], self.block_size, salt)
        n = 0
        with self._lock:
            while n < usable and hashes[n] in self._seen:
                n += 1
        return n * self.block_size

    def add(self, tokens: Sequence[int], salt: str | None = None) -> None:
        """Remember the full blocks of ``tokens`` (whose KV the engine computed)."""
        hashes = chain_hashes(tokens, self.block_size, salt)
        with self._lock:
            seen = self._seen
            for h in hashes:
                seen.pop(h, None)  # seen again: now the newest
                seen[h] = None
            while len(seen) > self.max_blocks:
                del seen[next(iter(seen))]

    def __len__(self) -> int:
        return len(self._seen)
