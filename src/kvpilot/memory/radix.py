"""Radix prefix cache over full KV blocks, with per-tier residency and leaf-first LRU eviction.

One tree per salt (tenant): tenants never share a prefix. Every edge holds whole blocks, so a
match is always block-aligned and a partial tail is always a miss. Split and insert keep the
deeper node's identity, so a node a trajectory locks always ends at the same depth.

    root --[sys prompt: blocks 7 3]--> A --[turn 1: blocks 12 1]--> B
                                         \\-[other session: 4]--> C
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence

from kvpilot.memory.block_pool import BlockPool
from kvpilot.memory.hashing import HASH_BYTES, chain_bytes, int32_bytes, root_hash
from kvpilot.memory.radix_check import check_radix
from kvpilot.memory.radix_evict import EvictionQueues, queue_limit
from kvpilot.memory.radix_lookup import RadixLookup
from kvpilot.memory.radix_node import (
    InsertResult,
    RadixNode,
    RadixObserver,
    RadixStats,
    TierTally,
    as_token_array,
)
from kvpilot.memory.radix_reuse import RadixReuse
from kvpilot.memory.tiers import DEVICE, Tier


def _counter_clock() -> Callable[[], float]:
    counter = itertools.count(1)
    return lambda: float(next(counter))


def _growable(node: RadixNode) -> list[int] | None:
    """The device blocks of ``node`` when its edge may grow in place (`RadixCache.
    extend_leaf`): a live non-root leaf whose single copy is on device, under one lock."""
    device = node.blocks.get(DEVICE)
    if (
        device is None
        or node.lock_count != 1
        or node.children
        or len(node.blocks) != 1
        or not node._alive
        or not node.depth_tokens  # a root
    ):
        return None
    return device


class RadixCache(RadixLookup, RadixReuse):
    """The tree holds one reference on every block it indexes, in every tier.

    Lookups (`match`, `touch_leaf`, `peek`) are in radix_lookup.py; eviction candidates wait
    in `EvictionQueues` (radix_evict.py), one lazy LRU heap per tier, and the full pool's
    evict-then-allocate fast paths are in radix_reuse.py; `check_invariants` is `check_radix`
    (radix_check.py).
    """

    def __init__(
        self,
        block_size: int,
        pools: Mapping[Tier, BlockPool],
        clock: Callable[[], float] | None = None,
        model: bytes = b"",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if Tier.DEVICE not in pools:
            raise ValueError("RadixCache needs a device pool")
        self.block_size = block_size
        self.model = model  # the model fingerprint seeding every root's hash
        self.pools = dict(pools)
        self.stats = RadixStats()
        self._clock = clock if clock is not None else _counter_clock()
        self._roots: dict[str | None, RadixNode] = {}
        self._tally = {tier: TierTally() for tier in Tier}
        self._device_tally = self._tally[DEVICE]  # the hot paths' tier
        self._device_pool = self.pools[DEVICE]
        self._queues = EvictionQueues()
        self._device_heap = self._queues._heaps[DEVICE]  # the queue keeps this list
        self._num_nodes = 0
        self._queue_limit = queue_limit(0)
        # The one optional sink for KV events (None: no event is built, no hash is computed).
        self.observer: RadixObserver | None = None
        self._lock_log = None

    def set_observer(self, observer: RadixObserver | None) -> None:
        """Attach (or detach) the event sink; every node's hashes are computed now, so that
        removals can always be reported (a node created later computes them on creation)."""
        if observer is not None:
            for node in self.iter_nodes():
                node.hashes  # noqa: B018 (computes and keeps them)
        self.observer = observer

    # ---- queries -------------------------------------------------------------------------

    def root(self, salt: str | None = None) -> RadixNode:
        node = self._roots.get(salt)
        if node is None:
            node = RadixNode(None, array("i"), {}, root_hash(salt, self.model), self._clock())
            self._roots[salt] = node
        return node

    def roots(self) -> dict[str | None, RadixNode]:
        return dict(self._roots)

    def cached_blocks(self, tier: Tier = Tier.DEVICE) -> int:
        tally = self._tally[tier]
        return tally.evictable + tally.locked

    def evictable_blocks(self, tier: Tier = Tier.DEVICE) -> int:
        return self._tally[tier].evictable

    @property
    def num_nodes(self) -> int:
        """Non-root nodes in the tree."""
        return self._num_nodes

    def iter_nodes(self) -> Iterator[RadixNode]:
        """Every node, roots included, parents before children."""
        for root in self._roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                yield node
                stack.extend(node.children.values())

    # ---- insert --------------------------------------------------------------------------

    def insert(
        self, tokens: Sequence[int], blocks: Sequence[int], salt: str | None = None
    ) -> InsertResult:
        return self.insert_below(self.root(salt), tokens, blocks)

    def insert_below(
        self, node: RadixNode, tokens: Sequence[int], blocks: Sequence[int]
    ) -> InsertResult:
        """``insert`` of ``tokens`` that continue the path ending at ``node`` (which must be alive).

        ``InsertResult.blocks`` covers only ``tokens``; used by trajectories so a commit costs
        O(new tokens) rather than O(context).
        """
        arr = as_token_array(tokens)
        bs = self.block_size
        if len(arr) != len(blocks) * bs:
            raise ValueError(
                f"insert needs exactly len(blocks) * block_size tokens: got {len(arr)} tokens "
                f"for {len(blocks)} blocks of {bs}"
            )
        if not node._alive:
            raise ValueError("cannot insert below a node that was evicted")
        query = arr.tobytes()
        end = len(query)
        step = 4 * bs
        now = self._clock()
        canonical: list[int] = []
        taken = 0
        offset = 0
        while offset < end:
            child = node.children.get(query[offset : offset + step])
            if child is None:
                break
            edge = child.tokens
            if offset + 4 * len(edge) <= end and query.startswith(edge, offset):
                k = len(edge) // bs
            else:
                k = self._common_blocks(edge, query, offset, end)
                if k < len(edge) // bs:
                    child = self._split(child, k)
            first = offset // step
            device = child.blocks.get(Tier.DEVICE)
            if device is None:
                own = list(blocks[first : first + k])
                self.pools[Tier.DEVICE].incref_many(own)
                self._attach_copy(child, Tier.DEVICE, own)
                device = own
                taken += k
                if self.observer is not None:
                    self.observer.committed(child.hashes)
            canonical.extend(device)
            child.last_access = now
            node = child
            offset += k * step
        if offset < end:
            first = offset // step
            own = list(blocks[first:])
            self.pools[Tier.DEVICE].incref_many(own)
            leaf = RadixNode(node, arr[offset // 4 :], {Tier.DEVICE: own}, None, now)
            node.children[query[offset : offset + step]] = leaf
            self._num_nodes += 1
            self._queue_limit += 2
            self._device_tally.evictable += len(own)  # a new leaf: unlocked
            self._push(leaf, Tier.DEVICE)
            canonical.extend(own)
            taken += len(own)
            node = leaf
            if self.observer is not None:
                self.observer.committed(leaf.hashes)
        self.stats.inserted_blocks += taken
        return InsertResult(node, canonical, taken)

    def extend_leaf(
        self,
        node: RadixNode,
        tokens: Sequence[int],
        blocks: Sequence[int],
        *,
        adopt: bool = False,
    ) -> bool:
        """Append whole blocks to ``node``'s edge in place (for the holder of its only lock).

        Only when ``node`` is a non-root leaf whose single copy is on device and that exactly
        one lock reaches; otherwise nothing changes and it returns False (use ``insert_below``).
        A decoding session that commits every full block then grows one node, not a chain of
        one-block nodes that would make every later match walk them all.

        ``adopt``: the caller hands its references on ``blocks`` to the tree (a trajectory
        committing its private blocks: its lock holds them from now on) instead of the tree
        taking new ones.
        """
        bs = self.block_size
        n = len(blocks)
        if len(tokens) != n * bs:
            raise ValueError(
                f"extend_leaf needs exactly len(blocks) * block_size tokens: got {len(tokens)} "
                f"tokens for {n} blocks of {bs}"
            )
        if not n:
            return _growable(node) is not None
        arr = tokens if isinstance(tokens, array) and tokens.typecode == "i" else None
        if not self.grow_leaf(node, as_token_array(tokens) if arr is None else arr, list(blocks)):
            return False
        if not adopt:
            self.pools[DEVICE].incref_many(blocks)
        return True

    def grow_leaf(self, node: RadixNode, tokens: array, blocks: list[int]) -> bool:
        """`extend_leaf` with ``adopt``, for a trajectory's commit (the hot path): without
        the checks of what the trajectory guarantees (``tokens`` an int32 array of exactly
        ``len(blocks) >= 1`` whole blocks, references it hands over)."""
        copies = node.blocks
        device = copies.get(DEVICE)
        # `_growable`, inline and without its tests of a root or a dead node: neither holds a
        # copy (a root's blocks are empty; a node dies only after every copy was released),
        # so ``device`` is None for both.
        if device is None or len(copies) != 1 or node.lock_count != 1 or node.children:
            return False
        n = len(blocks)
        hashes = node._hashes
        if hashes is not None:  # an observed tree keeps every node's (`set_observer`)
            new = chain_bytes(hashes[-HASH_BYTES:], int32_bytes(tokens), self.block_size)
            node._hashes = hashes + new
            if self.observer is not None:
                self.observer.committed(new)
        node.tokens += tokens
        device += blocks
        node.depth_tokens += n * self.block_size
        node.last_access = self._clock()
        self._device_tally.locked += n  # the leaf is locked
        self.stats.inserted_blocks += n
        return True

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node``'s edge after ``k`` blocks; the new upper node is returned."""
        bs = self.block_size
        parent = node.parent
        assert parent is not None
        upper = RadixNode(
            parent,
            node.tokens[: k * bs],
            {tier: ids[:k] for tier, ids in node.blocks.items()},
            None if node._hashes is None else node._hashes[: k * HASH_BYTES],
            node.last_access,
            node.lock_count,
        )
        parent.children[node.tokens[:bs].tobytes()] = upper
        node.tokens = node.tokens[k * bs :]
        node.blocks = {tier: ids[k:] for tier, ids in node.blocks.items()}
        if node._hashes is not None:
            node._hashes = node._hashes[k * HASH_BYTES :]
        node.parent = upper
        upper.children[node.tokens[:bs].tobytes()] = node
        self._num_nodes += 1
        self._queue_limit += 2
        if node.lock_count == 1 and self._lock_log is not None:
            self._lock_log.append(node)
        return upper

    # ---- tiers ---------------------------------------------------------------------------

    def add_copy(self, node: RadixNode, tier: Tier, blocks: list[int]) -> None:
        if node.is_root or not node._alive:
            raise ValueError("add_copy needs a live non-root node")
        if tier in node.blocks:
            raise ValueError(f"node at depth {node.depth_tokens} already has a {tier} copy")
        if tier not in self.pools:
            raise ValueError(f"no {tier} pool is configured")
        if len(blocks) != node.num_blocks:
            raise ValueError(
                f"a copy of this node needs {node.num_blocks} blocks, got {len(blocks)}"
            )
        self._attach_copy(node, tier, list(blocks))
        if self.observer is not None:
            self.observer.moved(tier, node.hashes)

    def _attach_copy(self, node: RadixNode, tier: Tier, blocks: list[int]) -> None:
        node.blocks[tier] = blocks
        if node.lock_count == 0:
            self._tally[tier].evictable += len(blocks)
        else:
            self._tally[tier].locked += len(blocks)
        self._push(node, tier)

    def drop_copy(self, node: RadixNode, tier: Tier) -> None:
        if node.is_root or not node._alive or tier not in node.blocks:
            raise ValueError(f"node has no {tier} copy to drop")
        if tier is Tier.DEVICE and node.lock_count > 0:
            raise ValueError("cannot drop the device copy of a locked node; unlock it first")
        self._release(node, tier)
        self._after_release(node, tier)

    # ---- integrity -----------------------------------------------------------------------

    def block_counts(self) -> dict[str, dict[Tier, int]]:
        """The tallies as ``{"cached": {tier: blocks}, "evictable": {tier: blocks}}``."""
        return {
            "cached": {tier: t.evictable + t.locked for tier, t in self._tally.items()},
            "evictable": {tier: t.evictable for tier, t in self._tally.items()},
        }

    def check_invariants(self) -> None:
        check_radix(
            self.roots(),
            self.block_size,
            self.pools,
            self.model,
            self.num_nodes,
            self.block_counts(),
        )
        if self._queue_limit != queue_limit(self._num_nodes):
            raise AssertionError(f"the queue limit {self._queue_limit} drifted from the node count")
