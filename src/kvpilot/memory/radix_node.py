"""Nodes of the radix prefix cache, the results its matches and inserts return, and the
int32 token arrays its edges hold."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvpilot.errors import InvalidRequest
from kvpilot.memory.hashing import HASH_BYTES, chain_bytes, int32_bytes
from kvpilot.memory.tiers import Tier


def as_token_array(tokens: Iterable[int]) -> array:
    """Tokens as ``array('i')`` (no copy if they already are one)."""
    if isinstance(tokens, array) and tokens.typecode == "i":
        return tokens
    try:
        if isinstance(tokens, np.ndarray):
            return array("i", np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
        return array("i", tokens)
    except (OverflowError, TypeError) as exc:
        raise InvalidRequest(f"token ids must be integers in int32 range: {exc}") from exc


class RadixNode:
    """One edge of the tree and the node at its end.

    ``tokens`` is an ``array('i')`` whose length is a multiple of the block size;
    ``blocks[tier]`` holds one block id per block of the edge for each tier where a copy
    lives (a non-root node always has at least one); ``hashes`` is the chained hash of each
    block, 16 bytes each, concatenated, computed on first read (only the disk tier and the
    router need them, so a commit does not pay for them). ``lock_count`` counts the locks
    taken on this node or any descendant: a node with ``lock_count > 0`` is never evicted.
    """

    __slots__ = (
        "_alive",
        "_hashes",
        "_queued",
        "blocks",
        "children",
        "depth_tokens",
        "last_access",
        "lock_count",
        "parent",
        "tokens",
    )

    def __init__(
        self,
        parent: RadixNode | None,
        tokens: array,
        blocks: dict[Tier, list[int]],
        hashes: bytes | None,
        last_access: float,
        lock_count: int = 0,
    ) -> None:
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.tokens = tokens
        self.blocks = blocks
        self._hashes = hashes
        self.lock_count = lock_count
        self.last_access = last_access
        self.depth_tokens: int = len(tokens) + (parent.depth_tokens if parent else 0)
        self._alive = True
        self._queued = 0

    @property
    def num_blocks(self) -> int:
        for ids in self.blocks.values():
            return len(ids)
        return 0

    @property
    def hashes(self) -> bytes:
        if self.is_root:
            return b""
        if self._hashes is None:
            if not self._alive:
                raise ValueError("the hashes of an evicted node were never computed")
            pending: list[RadixNode] = []
            node: RadixNode = self
            while node._hashes is None:
                pending.append(node)
                assert node.parent is not None
                node = node.parent
            tail = node._hashes[-HASH_BYTES:]
            for node in reversed(pending):
                bs = len(node.tokens) // node.num_blocks
                node._hashes = chain_bytes(tail, int32_bytes(node.tokens), bs)
                tail = node._hashes[-HASH_BYTES:]
        assert self._hashes is not None
        return self._hashes

    def last_hash(self) -> bytes:
        """Chained hash of the path's last block (the salt's seed for a root)."""
        if self.is_root:
            assert self._hashes is not None
            return self._hashes
        return self.hashes[-HASH_BYTES:]

    @property
    def is_root(self) -> bool:
        return self.depth_tokens == 0

    @property
    def alive(self) -> bool:
        """False once the node has been evicted or removed from the tree."""
        return self._alive

    def path_blocks(self, tier: Tier = Tier.DEVICE) -> list[int]:
        """Blocks in ``tier`` from the root to the end of this node."""
        chain: list[list[int]] = []
        node: RadixNode | None = self
        while node is not None and not node.is_root:
            chain.append(node.blocks[tier])
            node = node.parent
        return [b for blocks in reversed(chain) for b in blocks]

    def path_tokens(self) -> array:
        """The tokens from the root to the end of this node."""
        chain: list[array] = []
        node: RadixNode | None = self
        while node is not None and not node.is_root:
            chain.append(node.tokens)
            node = node.parent
        out = array("i")
        for tokens in reversed(chain):
            out.extend(tokens)
        return out

    def __repr__(self) -> str:
        tiers = ",".join(self.blocks)
        return (
            f"RadixNode(depth={self.depth_tokens}, blocks={self.num_blocks}, tiers=[{tiers}], "
            f"locks={self.lock_count}, children={len(self.children)})"
        )


class TierTally:
    """One tier's blocks in a radix tree, split by whether a lock holds their node:
    ``evictable`` (no lock) and ``locked``; the blocks cached in the tier are their sum.

    Kept split so that each hot path changes one count: a commit grows a locked leaf, an
    eviction trims an unlocked one (only a lock or an unlock moves blocks between the two).
    Fields of a slotted object rather than items of dicts keyed by tier: updating a field
    costs half what updating a dict's item does."""

    __slots__ = ("evictable", "locked")

    def __init__(self) -> None:
        self.evictable = 0
        self.locked = 0


@dataclass(frozen=True, slots=True)
class MatchResult:
    """A snapshot: read it before the next match or insert (either may split path nodes)."""

    node: RadixNode
    num_tokens: int
    path: list[RadixNode]

    def blocks(self, tier: Tier = Tier.DEVICE) -> list[int]:
        out: list[int] = []
        for node in self.path:
            ids = node.blocks.get(tier)
            if ids is None:
                raise ValueError(
                    f"matched node at depth {node.depth_tokens} has no {tier} copy; "
                    f"match with tier={tier.value!r} or load it into {tier} first"
                )
            out.extend(ids)
        return out

    def residency(self) -> list[frozenset[Tier]]:
        out: list[frozenset[Tier]] = []
        for node in self.path:
            out.extend([frozenset(node.blocks)] * node.num_blocks)
        return out


@dataclass(frozen=True, slots=True)
class PeekResult:
    """A read-only look: the longest cached block-aligned prefix in any tier (``num_tokens``)
    and, per tier, how many of its blocks have a copy there."""

    num_tokens: int
    blocks_by_tier: dict[Tier, int]


@dataclass(frozen=True, slots=True)
class InsertResult:
    node: RadixNode
    blocks: list[int]
    num_new_blocks: int


@dataclass(slots=True)
class RadixStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0
    inserted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Equation 2: matched prompt tokens over prompt tokens."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class RadixObserver(Protocol):
    """Told of every change to which blocks (by chained hash, 16 bytes each, concatenated)
    the cache indexes in which tier; the fleet's KV event log implements it."""

    def committed(self, hashes: bytes) -> None: ...

    def moved(self, tier: Tier, hashes: bytes) -> None: ...

    def evicted(self, tier: Tier, hashes: bytes) -> None: ...
