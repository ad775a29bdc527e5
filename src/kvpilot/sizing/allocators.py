"""Baseline KV allocators (spec "Memory Fragmentation", Napkin Math 0.2).

Three allocators over one pool of bytes: static worst-case reservation, contiguous power-of-two
buddy allocation, and paged allocation. Each reports the spec's three metrics:
    eta_alloc     = useful bytes / allocated bytes
    phi_ext(R)    = 1 - (free bytes in pieces that can serve a request of R bytes) / free bytes
    eta_effective = useful bytes / pool bytes
"A piece that can serve" follows each allocator: a free slot (static), a free buddy block of
the request's rounded size (buddy), a free block (paged). `holes()` lists the maximal runs of
contiguous free bytes in address order, the spec's H_k. `kvpilot.sizing.frag_lab` runs them
under workloads and the spec's scenarios.

Pure Python: the allocators model addresses, not memory.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from kvpilot.errors import ConfigError

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _runs(extents: list[tuple[int, int]]) -> list[int]:
    """Merge (offset, size) free extents into the sizes of maximal contiguous runs."""
    runs: list[list[int]] = []
    for offset, size in sorted(extents):
        if runs and runs[-1][0] + runs[-1][1] == offset:
            runs[-1][1] += size
        else:
            runs.append([offset, size])
    return [size for _, size in runs]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The pool at one instant, probed with a request of `request_bytes`."""

    admitted: int
    useful_bytes: int
    allocated_bytes: int
    free_bytes: int
    eta_alloc: float
    phi_ext: float
    eta_effective: float


class KvAllocator(ABC):
    """A pool of `pool_bytes` holding requests of `token_bytes` per token.

    A request is admitted whole at its final length (the case most favourable to contiguous
    allocators: no growth, no reallocation copies) and released whole.
    """

    name: str

    def __init__(self, pool_bytes: int, token_bytes: int) -> None:
        if pool_bytes <= 0 or token_bytes <= 0:
            raise ConfigError("pool and token sizes must be positive")
        self.pool_bytes = pool_bytes
        self.token_bytes = token_bytes
        self._tokens: dict[int, int] = {}
        self._allocated: dict[int, int] = {}

    @abstractmethod
    def reservation_bytes(self, nbytes: int) -> int:
        """Bytes this allocator claims for a request that needs `nbytes`."""

    @abstractmethod
    def _claim(self, request_id: int, reserve: int) -> bool: ...

    @abstractmethod
    def _unclaim(self, request_id: int) -> None: ...

    @abstractmethod
    def _servable_free_bytes(self, reserve: int) -> int:
        """Free bytes lying in pieces each able to hold a reservation of `reserve` bytes."""

    @abstractmethod
    def free_extents(self) -> list[tuple[int, int]]:
        """Free (offset, size) extents, including an unusable tail of the pool."""

    def admit(self, request_id: int, tokens: int, reserve_bytes: int | None = None) -> bool:
        """Admit a request holding `tokens` tokens, reserving at least `reserve_bytes`."""
        if request_id in self._tokens:
            raise ConfigError(f"request {request_id} is already admitted")
        if tokens < 0:
            raise ConfigError("a request cannot hold a negative number of tokens")
        reserve = self.reservation_bytes(max(tokens * self.token_bytes, reserve_bytes or 0))
        if not self._claim(request_id, reserve):
            return False
        self._tokens[request_id] = tokens
        self._allocated[request_id] = reserve
        return True

    def release(self, request_id: int) -> None:
        self._unclaim(request_id)
        del self._tokens[request_id]
        del self._allocated[request_id]

    @property
    def live(self) -> list[int]:
        return list(self._tokens)

    @property
    def allocated_bytes(self) -> int:
        return sum(self._allocated.values())

    @property
    def free_bytes(self) -> int:
        return self.pool_bytes - self.allocated_bytes

    def holes(self) -> list[int]:
        """Sizes of the maximal contiguous free runs, in address order (the spec's H_k)."""
        return _runs(self.free_extents())

    def fits(self, request_bytes: int) -> bool:
        reserve = self.reservation_bytes(request_bytes)
        return self._servable_free_bytes(reserve) >= reserve

    def phi_ext(self, request_bytes: int) -> float:
        """External fragmentation for a request of `request_bytes`; 0 when nothing is free."""
        free = self.free_bytes
        if free == 0:
            return 0.0
        return 1.0 - self._servable_free_bytes(self.reservation_bytes(request_bytes)) / free

    def snapshot(self, request_bytes: int) -> Snapshot:
        useful = sum(self._tokens.values()) * self.token_bytes
        allocated = self.allocated_bytes
        return Snapshot(
            admitted=len(self._tokens),
            useful_bytes=useful,
            allocated_bytes=allocated,
            free_bytes=self.pool_bytes - allocated,
            eta_alloc=useful / allocated if allocated else 0.0,
            phi_ext=self.phi_ext(request_bytes),
            eta_effective=useful / self.pool_bytes,
        )

    def check_invariants(self) -> None:
        extents = sorted(self.free_extents())
        for (a, sa), (b, _) in itertools.pairwise(extents):
            assert a + sa <= b, "free extents overlap"
        assert sum(s for _, s in extents) == self.free_bytes, "free + allocated != pool"
        for rid, tokens in self._tokens.items():
            assert tokens * self.token_bytes <= self._allocated[rid], "request outgrew its claim"


class StaticAllocator(KvAllocator):
    """Worst-case reservation: every request claims a slot of `max_tokens` tokens."""

    name = "static"

    def __init__(self, pool_bytes: int, token_bytes: int, max_tokens: int) -> None:
        super().__init__(pool_bytes, token_bytes)
        if max_tokens <= 0:
            raise ConfigError("S_max must be positive")
        self.slot_bytes = max_tokens * token_bytes
        self.num_slots = pool_bytes // self.slot_bytes
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._slot_of: dict[int, int] = {}

    def reservation_bytes(self, nbytes: int) -> int:
        return self.slot_bytes if nbytes <= self.slot_bytes else nbytes

    def _claim(self, request_id: int, reserve: int) -> bool:
        if reserve > self.slot_bytes:
            raise ConfigError(
                f"request of {reserve} bytes exceeds the {self.slot_bytes}-byte S_max slot"
            )
        if not self._free_slots:
            return False
        self._slot_of[request_id] = self._free_slots.pop()
        return True

    def _unclaim(self, request_id: int) -> None:
        self._free_slots.append(self._slot_of.pop(request_id))

    def _servable_free_bytes(self, reserve: int) -> int:
        return len(self._free_slots) * self.slot_bytes if reserve <= self.slot_bytes else 0

    def free_extents(self) -> list[tuple[int, int]]:
        extents = [(s * self.slot_bytes, self.slot_bytes) for s in self._free_slots]
        tail = self.num_slots * self.slot_bytes
        if tail < self.pool_bytes:
            extents.append((tail, self.pool_bytes - tail))
        return extents


class BuddyAllocator(KvAllocator):
    """Contiguous power-of-two buddy allocation over the pool.

    The pool is cut into power-of-two chunks, largest first, so every chunk is aligned to its
    size and a block's buddy is at `offset ^ size`. Claims round up to a power of two (at least
    `min_block_bytes`); freed blocks merge with free buddies.
    """

    name = "buddy"

    def __init__(
        self, pool_bytes: int, token_bytes: int, min_block_bytes: int | None = None
    ) -> None:
        super().__init__(pool_bytes, token_bytes)
        self.min_block = _next_pow2(min_block_bytes or token_bytes)
        self._free: dict[int, set[int]] = {}
        self._block_of: dict[int, tuple[int, int]] = {}
        self._chunks: list[tuple[int, int]] = []
        managed = pool_bytes // self.min_block * self.min_block
        offset = 0
        for bit in range(managed.bit_length() - 1, -1, -1):
            size = 1 << bit
            if managed & size:
                self._chunks.append((offset, size))
                self._free.setdefault(size, set()).add(offset)
                offset += size
        self.managed_bytes = managed

    def reservation_bytes(self, nbytes: int) -> int:
        return max(self.min_block, _next_pow2(nbytes))

    def _split_to(self, size: int, offset: int, block: int, target: int) -> None:
        """Split free block (offset, block) until the piece at `target` has `size` bytes."""
        self._free[block].discard(offset)
        while block > size:
            block //= 2
            buddy = offset + block
            if target >= buddy:
                offset, buddy = buddy, offset
            self._free.setdefault(block, set()).add(buddy)
        assert offset == target

    def _claim(self, request_id: int, reserve: int) -> bool:
        candidates = sorted(s for s, offs in self._free.items() if s >= reserve and offs)
        if not candidates:
            return False
        block = candidates[0]
        offset = min(self._free[block])
        self._split_to(reserve, offset, block, offset)
        self._block_of[request_id] = (offset, reserve)
        return True

    def place(
        self, request_id: int, offset: int, tokens: int, reserve_bytes: int | None = None
    ) -> None:
        """Admit a request into the block at `offset` (to build a given layout, as in a test)."""
        size = self.reservation_bytes(max(tokens * self.token_bytes, reserve_bytes or 0))
        if offset % size:
            raise ConfigError(f"offset {offset} is not aligned to the {size}-byte block")
        found = next(
            (
                (start, block)
                for block, offsets in self._free.items()
                for start in offsets
                if block >= size and start <= offset < start + block
            ),
            None,
        )
        if found is not None:
            self._split_to(size, found[0], found[1], offset)
            self._block_of[request_id] = (offset, size)
            self._tokens[request_id] = tokens
            self._allocated[request_id] = size
            return
        raise ConfigError(f"no free block holds [{offset}, {offset + size})")

    def _chunk_size(self, offset: int) -> int:
        return next(s for base, s in self._chunks if base <= offset < base + s)

    def _unclaim(self, request_id: int) -> None:
        offset, size = self._block_of.pop(request_id)
        limit = self._chunk_size(offset)
        while size < limit and (offset ^ size) in self._free.get(size, ()):
            self._free[size].discard(offset ^ size)
            offset = min(offset, offset ^ size)
            size *= 2
        self._free.setdefault(size, set()).add(offset)

    def _servable_free_bytes(self, reserve: int) -> int:
        return sum(s * len(offs) for s, offs in self._free.items() if s >= reserve)

    def free_extents(self) -> list[tuple[int, int]]:
        extents = [(o, s) for s, offs in self._free.items() for o in offs]
        if self.managed_bytes < self.pool_bytes:
            extents.append((self.managed_bytes, self.pool_bytes - self.managed_bytes))
        return extents

    def check_invariants(self) -> None:
        super().check_invariants()
        for size, offsets in self._free.items():
            for offset in offsets:
                assert offset % size == 0, "free block not aligned to its size"
                if size < self._chunk_size(offset):
                    assert (offset ^ size) not in offsets, "two free buddies were not merged"


class PagedAllocator(KvAllocator):
    """Paged allocation: fixed blocks of `block_size` tokens, any free block serves any request."""

    name = "paged"

    def __init__(self, pool_bytes: int, token_bytes: int, block_size: int = 16) -> None:
        super().__init__(pool_bytes, token_bytes)
        if block_size <= 0:
            raise ConfigError("block size must be positive")
        self.block_size = block_size
        self.block_bytes = block_size * token_bytes
        self.num_blocks = pool_bytes // self.block_bytes
        self._free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self._blocks_of: dict[int, list[int]] = {}

    def reservation_bytes(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.block_bytes) * self.block_bytes

    def _claim(self, request_id: int, reserve: int) -> bool:
        need = reserve // self.block_bytes
        if need > len(self._free_blocks):
            return False
        self._blocks_of[request_id] = [self._free_blocks.pop() for _ in range(need)]
        return True

    def _unclaim(self, request_id: int) -> None:
        self._free_blocks.extend(reversed(self._blocks_of.pop(request_id)))

    def _servable_free_bytes(self, reserve: int) -> int:
        return len(self._free_blocks) * self.block_bytes  # any block serves: none is stranded

    def free_extents(self) -> list[tuple[int, int]]:
        extents = [(b * self.block_bytes, self.block_bytes) for b in self._free_blocks]
        tail = self.num_blocks * self.block_bytes
        if tail < self.pool_bytes:
            extents.append((tail, self.pool_bytes - tail))
        return extents
