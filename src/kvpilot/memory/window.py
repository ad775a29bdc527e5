"""The sliding-window layer group: its own device block pool, and its own prefix cache.

A hybrid model (Mistral: every layer windowed; Qwen2/Qwen3 with ``max_window_layers`` or
``layer_types``: some layers windowed) keeps two groups of KV, each in its own physical pool
of blocks of the same ``block_size``:

- the *full* group: the `BlockPool` and radix of `KVManager`, exactly as for any model
  (block ids index the full-attention layers' KV; none at all for an all-windowed model);
- the *window* group (this module): block ids index the sliding-window layers' KV. A query
  at position p reads keys at positions > p - W only, so block i is *needed* at p iff its
  last position ``(i + 1) * B - 1 > p - W``, i.e. ``i >= first_needed(p)``.

Each trajectory keeps a window table parallel to its block table (`WindowTable`): entries
below ``first_needed(p)`` (p: the next query position, ``num_computed_tokens``) are the
null block, the rest held with one reference each. Block 0 of the pool is the null block:
never handed out, never freed, all zeros on the model side, so the attention kernels may
read it (its positions are masked) without touching anyone's KV.

Prefix cache: a released full block is *published* under its chained hash (the same
`block_hash` chain as the radix, seeded by salt and model) and stays cached, holding one
reference, until the pool needs room (LRU eviction of entries nobody else holds). A prefix
hit at h tokens is valid for the window group iff every block ``first_needed(h) .. h/B - 1``
is held by the trajectory or cached; otherwise the hit is cut back to the longest valid
block boundary (`longest_valid`). Window-group KV never moves to host or disk: a paused
session's last window stays on the device as evictable cache entries, and if they are
evicted by then its resume recomputes from the longest valid point.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from kvpilot.errors import ConfigError, require
from kvpilot.memory.block_pool import BlockPool
from kvpilot.memory.tiers import Tier

NULL_BLOCK = 0


def first_needed(pos: int, window: int, block_size: int) -> int:
    """The first block index a query at position ``pos`` reads under window ``window``."""
    return max(0, (pos - window + 1) // block_size)


def max_held_blocks(window: int, block_size: int) -> int:
    """Most blocks of computed KV a sequence holds in the window group: ceil(W/B) + 1."""
    return -(-window // block_size) + 1


class WindowPool:
    """The window group's device pool (block 0 reserved as the null block) and its cache.

    ``block_bytes``: one block of the window layers' KV on the device (0 when the executor
    does not say), for what releasing saves (`kvpilot.engine.snapshot.WindowPoolUsage`).
    """

    __slots__ = (
        "_cached",
        "block_bytes",
        "block_size",
        "cache",
        "evictions",
        "hits",
        "pool",
        "window",
    )
    # hits: blocks a prefix hit took from the cache; evictions: cache entries evicted

    def __init__(self, num_blocks: int, window: int, block_size: int, block_bytes: int = 0) -> None:
        if window < 1:
            raise ConfigError(f"a sliding window must be >= 1 token, got {window}")
        if num_blocks < 2:
            raise ConfigError(
                f"the window group needs >= 2 blocks (one is the null block), got {num_blocks}"
            )
        self.window = window
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.pool = BlockPool(num_blocks, Tier.DEVICE)
        null = self.pool.allocate(1)[0]
        assert null == NULL_BLOCK
        self.cache: OrderedDict[bytes, int] = OrderedDict()  # hash -> block, LRU first
        self._cached = np.zeros(num_blocks, dtype=bool)  # block -> in the cache (vectorised)
        self.hits = 0
        self.evictions = 0

    @property
    def num_blocks(self) -> int:
        """Blocks that can hold KV (the null block excluded)."""
        return self.pool.num_blocks - 1

    def first_needed(self, pos: int) -> int:
        return first_needed(pos, self.window, self.block_size)

    @property
    def used_blocks(self) -> int:
        """Blocks not on the free list (held or cached), the null block excluded."""
        return self.pool.num_used - 1

    def held_blocks(self) -> int:
        """Blocks that are neither free nor evictable cache entries."""
        return self.pool.num_used - 1 - self.evictable_blocks()

    def evictable_blocks(self) -> int:
        """Cache entries nobody else holds (one vectorised pass over the pool's refcounts:
        admission asks every step)."""
        return int(np.count_nonzero(self._cached & (self.pool.refcounts() == 1)))

    def free_blocks(self) -> int:
        """Blocks an allocation can count on: free now plus evictable from the cache."""
        return self.pool.num_free + self.evictable_blocks()

    def held_usage(self) -> float:
        """Held blocks over the pool's (the null block excluded): what admission weighs."""
        return (self.num_blocks - self.free_blocks()) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, evicting cache entries nobody holds if short (OutOfBlocks if
        still short)."""
        short = n - self.pool.num_free
        if short > 0:
            self._evict(short)
        return self.pool.allocate(n)

    def _evict(self, n: int) -> None:
        refcount = self.pool.refcount
        victims: list[bytes] = []
        for h, block in self.cache.items():  # least recently used first
            if refcount(block) == 1:
                victims.append(h)
                if len(victims) == n:
                    break
        cached = self._cached
        for h in victims:
            block = self.cache.pop(h)
            cached[block] = False
            self.pool.decref(block)
        self.evictions += len(victims)

    def publish(self, key: bytes, block: int) -> None:
        """Cache ``block`` (a full block's window KV) under its chained hash ``key``."""
        cached = self.cache.get(key)
        if cached is not None:
            self.cache.move_to_end(key)
            return
        self.pool.incref(block)
        self.cache[key] = block
        self._cached[block] = True

    def lookup(self, key: bytes) -> int | None:
        block = self.cache.get(key)
        if block is not None:
            self.cache.move_to_end(key)
        return block

    def release(self, blocks: list[int]) -> None:
        held = [b for b in blocks if b != NULL_BLOCK]
        if held:
            self.pool.decref_many(held)

    def set_on_free(self, hook: Callable[[list[int]], None] | None) -> None:
        self.pool.on_free = hook

    def check_invariants(self, expected: list[int]) -> None:
        """``expected[b]``: the references trajectories hold on block b; adds the cache's and
        the null block's own, then compares with the pool's refcounts."""
        self.pool.check_invariants()
        counts = list(expected)
        counts[NULL_BLOCK] += 1
        for block in self.cache.values():
            require(block != NULL_BLOCK, "the window cache holds the null block")
            counts[block] += 1
        in_cache = np.zeros(self.pool.num_blocks, dtype=bool)
        in_cache[list(self.cache.values())] = True
        require(bool((in_cache == self._cached).all()), "the window cache's block mask is stale")
        refs = self.pool.refcounts()
        for block, n in enumerate(counts):
            require(
                int(refs[block]) == n,
                f"window block {block}: refcount {int(refs[block])}, but trajectories and the "
                f"window cache hold {n} references",
            )
