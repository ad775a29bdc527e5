"""A fixed-capacity pool of KV blocks in one tier: LIFO free list plus reference counts."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NoReturn

import numpy as np

from kvpilot.errors import ConfigError, OutOfBlocks
from kvpilot.memory.tiers import Tier


class BlockPool:
    """Blocks are ids ``0 .. num_blocks - 1``.

    Invariant: a block is on the free list exactly when its refcount is 0. The free list is
    LIFO so a just-freed block (still warm in caches, still mapped) is reused first.
    Refcounts are a plain list: nearly every call touches one to a few blocks, where a list
    item costs a fraction of a numpy element (the simulator's hot path).

    ``on_free``, when set, is called with the blocks each release put back on the free list
    (the engine's hook that poisons freed KV when ``poison_freed_blocks`` is on).
    """

    __slots__ = ("_free", "_refcounts", "num_blocks", "on_free", "tier")

    def __init__(self, num_blocks: int, tier: Tier = Tier.DEVICE) -> None:
        if num_blocks < 0:
            raise ConfigError(f"{tier} pool: num_blocks must be >= 0, got {num_blocks}")
        self.tier = tier
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refcounts = [0] * num_blocks
        self.on_free: Callable[[list[int]], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """U_KV: fraction of the pool's blocks in use (0.0 for an empty pool)."""
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        free = self._free
        if n > len(free):
            raise OutOfBlocks(self.tier, n, len(free))
        if n == 1:  # the decode hot path
            block = free.pop()
            self._refcounts[block] = 1
            return [block]
        if n == 0:
            return []
        blocks = free[-n:]
        del free[-n:]
        blocks.reverse()
        refs = self._refcounts
        for block in blocks:
            refs[block] = 1
        return blocks

    def _in_use(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise ValueError(
                f"{self.tier} pool: block {block} is out of range 0..{self.num_blocks}"
            )
        count = self._refcounts[block]
        if count <= 0:
            raise ValueError(f"{self.tier} pool: block {block} is free; it must be allocated first")
        return count

    def incref(self, block: int) -> None:
        self._refcounts[block] = self._in_use(block) + 1

    def incref_many(self, blocks: Sequence[int]) -> None:
        """incref each of ``blocks`` (distinct ids, all in use); nothing changes if one is not."""
        refs = self._refcounts
        block = -1
        try:
            for block in blocks:  # one pass (the hot path: every block in use)
                count = refs[block]
                if count <= 0 or block < 0:  # free, or a negative id indexing from the end
                    self._undo(blocks, block, -1)
                refs[block] = count + 1
        except IndexError:  # an id past the end
            self._undo(blocks, block, -1)

    def decref(self, block: int) -> bool:
        count = self._in_use(block) - 1
        self._refcounts[block] = count
        if count == 0:
            self._free.append(block)
            if self.on_free is not None:
                self.on_free([block])
            return True
        return False

    def decref_one(self, block: int) -> int:
        """`decref_many` of one block, without the list: returns 1 if it became free, else 0."""
        refs = self._refcounts
        try:
            count = refs[block]
        except IndexError:  # an id past the end
            count = 0
        if count == 1 and block >= 0:  # the hot path: the last reference goes
            refs[block] = 0
            self._free.append(block)
            if self.on_free is not None:
                self.on_free([block])
            return 1
        if count <= 0 or block < 0:  # free, out of range, or a negative id indexing from the end
            self._in_use(block)
        refs[block] = count - 1
        return 0

    def decref_many(self, blocks: Sequence[int]) -> int:
        """decref each of ``blocks`` (distinct ids, all in use; nothing changes if one is not);
        returns how many became free."""
        refs = self._refcounts
        freed: list[int] = []
        block = -1
        try:
            for block in blocks:  # one pass (the hot path: every block in use)
                count = refs[block]
                if count <= 1 or block < 0:
                    if count <= 0 or block < 0:  # free, or a negative id indexing from the end
                        self._undo(blocks, block, 1)
                    freed.append(block)
                refs[block] = count - 1
        except IndexError:  # an id past the end
            self._undo(blocks, block, 1)
        if freed:
            self._free.extend(freed)
            if self.on_free is not None:
                self.on_free(freed)
        return len(freed)

    def _undo(self, blocks: Sequence[int], bad: int, delta: int) -> NoReturn:
        """A many-block change met ``bad`` (free or out of range): add ``delta`` back to every
        block before it (ids are distinct, so ``index`` finds where it stopped), then raise."""
        refs = self._refcounts
        for block in blocks[: blocks.index(bad)]:
            refs[block] += delta
        self._in_use(bad)
        raise AssertionError(f"unreachable: _in_use raises for block {bad}")

    def free(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.decref(block)

    def refcount(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise ValueError(
                f"{self.tier} pool: block {block} is out of range 0..{self.num_blocks}"
            )
        return self._refcounts[block]

    def refcounts(self) -> np.ndarray:
        """A copy of every block's refcount (for invariant checks and telemetry)."""
        return np.array(self._refcounts, dtype=np.int32)

    def check_invariants(self) -> None:
        free = self._free
        refs = self.refcounts()
        if len(set(free)) != len(free):
            raise AssertionError(f"{self.tier} pool: a block is on the free list twice")
        if free and not (min(free) >= 0 and max(free) < self.num_blocks):
            raise AssertionError(f"{self.tier} pool: free list holds an out-of-range block")
        if (refs < 0).any():
            raise AssertionError(
                f"{self.tier} pool: negative refcount on block {int(np.argmin(refs))}"
            )
        on_free = np.zeros(self.num_blocks, dtype=bool)
        on_free[free] = True
        leaked = np.flatnonzero(~on_free & (refs == 0))
        if leaked.size:
            raise AssertionError(
                f"{self.tier} pool: block {int(leaked[0])} has refcount 0 but is not free"
            )
        busy = np.flatnonzero(on_free & (refs != 0))
        if busy.size:
            raise AssertionError(
                f"{self.tier} pool: free block {int(busy[0])} has a nonzero refcount"
            )
