"""Radix prefix cache over full KV blocks, with per-tier residency and leaf-first LRU eviction.

One tree per salt (tenant): tenants never share a prefix. Every edge holds whole blocks, so a
match is always block-aligned and a partial tail is always a miss. Split and insert keep the
deeper node's identity, so a node a trajectory locks always ends at the same depth.

    root --[sys prompt: blocks 7 3]--> A --[turn 1: blocks 12 1]--> B
                                         \\-[other session: 4]--> C
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import numpy as np

from kvpilot.errors import InvalidRequest
from kvpilot.memory.block_pool import BlockPool
from kvpilot.memory.hashing import HASH_BYTES, chain_bytes, int32_bytes, root_hash
from kvpilot.memory.radix_node import InsertResult, MatchResult, RadixNode, RadixStats
from kvpilot.memory.tiers import Tier

_TIER_BIT = {Tier.DEVICE: 1, Tier.HOST: 2, Tier.DISK: 4}


class RadixObserver(Protocol):
    """Told of every change to which blocks (by chained hash, 16 bytes each, concatenated)
    the cache indexes in which tier; the fleet's KV event log implements it."""

    def committed(self, hashes: bytes) -> None: ...

    def moved(self, tier: Tier, hashes: bytes) -> None: ...

    def evicted(self, tier: Tier, hashes: bytes) -> None: ...


def as_token_array(tokens: Sequence[int]) -> array:
    """Tokens as ``array('i')`` (no copy if they already are one)."""
    if isinstance(tokens, array) and tokens.typecode == "i":
        return tokens
    try:
        if isinstance(tokens, np.ndarray):
            return array("i", np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
        return array("i", tokens)
    except (OverflowError, TypeError) as exc:
        raise InvalidRequest(f"token ids must be integers in int32 range: {exc}") from exc


def _counter_clock() -> Callable[[], float]:
    counter = itertools.count(1)
    return lambda: float(next(counter))


class RadixCache:
    """The tree holds one reference on every block it indexes, in every tier.

    Eviction candidates live in one lazy min-heap per tier keyed by ``last_access``: an entry
    may be stale (older than the node's true access time, or no longer a candidate) and is
    fixed when popped. ``node._queued`` has a bit per tier whose heap holds an entry for it;
    every node that is a candidate has its bit set.
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
        self._cached = {tier: 0 for tier in Tier}
        self._evictable = {tier: 0 for tier in Tier}
        self._heaps: dict[Tier, list[tuple[float, int, RadixNode]]] = {tier: [] for tier in Tier}
        self._seq = itertools.count()
        self._num_nodes = 0
        # The one optional sink for KV events (None: no event is built, no hash is computed).
        self.observer: RadixObserver | None = None

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

    def match(
        self,
        tokens: Sequence[int],
        salt: str | None = None,
        *,
        record: bool = True,
        tier: Tier | None = Tier.DEVICE,
    ) -> MatchResult:
        arr = as_token_array(tokens)
        bs = self.block_size
        node = self.root(salt)
        query = arr.tobytes()
        end = len(arr) // bs * bs * 4
        step = 4 * bs
        path: list[RadixNode] = []
        now = self._clock()
        offset = 0
        while offset < end:  # hot path
            child = node.children.get(query[offset : offset + step])
            if child is None or (tier is not None and tier not in child.blocks):
                break
            edge = child.tokens
            if offset + 4 * len(edge) <= end and query.startswith(edge, offset, end):
                k = len(edge) // bs
            else:
                k = self._common_blocks(edge, query, offset, end)
                if k < len(edge) // bs:
                    child = self._split(child, k)
            child.last_access = now
            path.append(child)
            node = child
            offset += k * step
            if k * bs < len(edge):
                break
        num_tokens = offset // 4
        if record:
            self.stats.queried_tokens += len(arr)
            self.stats.hit_tokens += num_tokens
        return MatchResult(node, num_tokens, path)

    def _common_blocks(self, edge: array, query: bytes, offset: int, end: int) -> int:
        n = min(len(edge), (end - offset) // 4)
        a = np.frombuffer(edge, dtype=np.int32, count=n)
        b = np.frombuffer(query, dtype=np.int32, count=n, offset=offset)
        diff = np.flatnonzero(a != b)
        first = int(diff[0]) if diff.size else n
        return first // self.block_size

    def cached_blocks(self, tier: Tier = Tier.DEVICE) -> int:
        return self._cached[tier]

    def evictable_blocks(self, tier: Tier = Tier.DEVICE) -> int:
        return self._evictable[tier]

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
            self._cached[Tier.DEVICE] += len(own)
            self._evictable[Tier.DEVICE] += len(own)
            self._push(leaf, Tier.DEVICE)
            canonical.extend(own)
            taken += len(own)
            node = leaf
            if self.observer is not None:
                self.observer.committed(leaf.hashes)
        self.stats.inserted_blocks += taken
        return InsertResult(node, canonical, taken)

    def extend_leaf(self, node: RadixNode, tokens: Sequence[int], blocks: Sequence[int]) -> bool:
        """Append whole blocks to ``node``'s edge in place (for the holder of its only lock).

        Only when ``node`` is a non-root leaf whose single copy is on device and that exactly
        one lock reaches; otherwise nothing changes and it returns False (use ``insert_below``).
        A decoding session that commits every full block then grows one node, not a chain of
        one-block nodes that would make every later match walk them all.
        """
        bs = self.block_size
        if len(tokens) != len(blocks) * bs:
            raise ValueError(
                f"extend_leaf needs exactly len(blocks) * block_size tokens: got {len(tokens)} "
                f"tokens for {len(blocks)} blocks of {bs}"
            )
        device = node.blocks.get(Tier.DEVICE)
        if (
            node.is_root
            or not node._alive
            or node.children
            or node.lock_count != 1
            or device is None
            or len(node.blocks) != 1
        ):
            return False
        if not blocks:
            return True
        arr = as_token_array(tokens)
        own = list(blocks)
        self.pools[Tier.DEVICE].incref_many(own)
        if self.observer is not None:
            node.hashes  # noqa: B018 (an observed tree keeps every node's hashes)
        if node._hashes is not None:
            new = chain_bytes(node._hashes[-HASH_BYTES:], int32_bytes(arr), bs)
            node._hashes += new
            if self.observer is not None:
                self.observer.committed(new)
        node.tokens.extend(arr)
        device.extend(own)
        node.depth_tokens += len(arr)
        node.last_access = self._clock()
        self._cached[Tier.DEVICE] += len(own)
        self.stats.inserted_blocks += len(own)
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
        return upper

    # ---- locks ---------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        if not node._alive:
            raise ValueError("cannot lock a node that was evicted")
        n: RadixNode | None = node
        while n is not None:
            if Tier.DEVICE not in n.blocks and not n.is_root:
                raise ValueError(
                    f"cannot lock: node at depth {n.depth_tokens} has no device copy; load it first"
                )
            n = n.parent
        n = node
        while n is not None:
            if n.lock_count == 0 and not n.is_root:
                for tier, ids in n.blocks.items():
                    self._evictable[tier] -= len(ids)
            n.lock_count += 1
            n = n.parent

    def unlock(self, node: RadixNode) -> None:
        n: RadixNode | None = node
        while n is not None:
            if n.lock_count <= 0:
                raise ValueError(f"unlock of node at depth {n.depth_tokens} that is not locked")
            n = n.parent
        n = node
        while n is not None:
            n.lock_count -= 1
            if n.lock_count == 0 and not n.is_root:
                for tier, ids in n.blocks.items():
                    self._evictable[tier] += len(ids)
                    self._push(n, tier)
            n = n.parent

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
        self._cached[tier] += len(blocks)
        if node.lock_count == 0:
            self._evictable[tier] += len(blocks)
        self._push(node, tier)

    def drop_copy(self, node: RadixNode, tier: Tier) -> None:
        if node.is_root or not node._alive or tier not in node.blocks:
            raise ValueError(f"node has no {tier} copy to drop")
        if tier is Tier.DEVICE and node.lock_count > 0:
            raise ValueError("cannot drop the device copy of a locked node; unlock it first")
        self._release(node, tier)
        self._after_release(node, tier)

    # ---- eviction ------------------------------------------------------------------------

    def evict(self, num_blocks: int, tier: Tier = Tier.DEVICE) -> int:
        """Leaf-first LRU; returns ``tier`` blocks freed (fewer when nothing more is evictable).

        A candidate larger than what is still needed is split and only its tail blocks go, so
        freeing one block never drops a whole 2k-token turn.
        """
        freed = 0
        while freed < num_blocks:
            node = self._pop_candidate(tier)
            if node is None:
                break
            want = num_blocks - freed
            if node.num_blocks > want:
                if not node.children and len(node.blocks) == 1:
                    freed += self._trim_tail(node, tier, want)
                    continue
                self._split(node, node.num_blocks - want)
            freed += self._release(node, tier)
            freed += self._after_release(node, tier)
        self.stats.evicted_blocks += freed
        return freed

    def _trim_tail(self, node: RadixNode, tier: Tier, n: int) -> int:
        """Evict the last ``n`` blocks of a childless single-copy leaf in place (no edge copy)."""
        bs = self.block_size
        ids = node.blocks[tier]
        if self.observer is not None:
            self.observer.evicted(tier, node.hashes[-n * HASH_BYTES :])
        tail = ids[-n:]
        del ids[-n:]
        del node.tokens[-n * bs :]
        if node._hashes is not None:
            node._hashes = node._hashes[: -n * HASH_BYTES]
        node.depth_tokens -= n * bs
        self._cached[tier] -= n
        self._evictable[tier] -= n
        self._push(node, tier)
        return self.pools[tier].decref_many(tail)

    def _release(self, node: RadixNode, tier: Tier) -> int:
        """Drop ``node``'s copy in ``tier``; returns blocks that went back to the free list."""
        if self.observer is not None:
            self.observer.evicted(tier, node.hashes)
        ids = node.blocks.pop(tier)
        self._cached[tier] -= len(ids)
        if node.lock_count == 0:
            self._evictable[tier] -= len(ids)
        return self.pools[tier].decref_many(ids)

    def _after_release(self, node: RadixNode, tier: Tier) -> int:
        """Remove ``node`` if copyless, requeue its parent; returns ``tier`` blocks freed."""
        parent = node.parent
        assert parent is not None
        freed = 0
        if not node.blocks:
            del parent.children[node.tokens[: self.block_size].tobytes()]
            freed = self._discard_subtree(node, tier)
            for t in parent.blocks:
                self._push(parent, t)
        else:
            self._push(parent, tier)
        return freed

    def _discard_subtree(self, top: RadixNode, tier: Tier) -> int:
        freed = 0
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for t in list(node.blocks):
                n = self._release(node, t)
                if t is tier:
                    freed += n
            node.children = {}
            node.parent = None
            node._alive = False
            self._num_nodes -= 1
        return freed

    def _is_candidate(self, node: RadixNode, tier: Tier) -> bool:
        return (
            node._alive
            and node.lock_count == 0
            and tier in node.blocks
            and not node.is_root
            and not any(tier in c.blocks for c in node.children.values())
        )

    def _push(self, node: RadixNode, tier: Tier) -> None:
        bit = _TIER_BIT[tier]
        if node._queued & bit or not self._is_candidate(node, tier):
            return
        node._queued |= bit
        heap = self._heaps[tier]
        heapq.heappush(heap, (node.last_access, next(self._seq), node))
        if len(heap) > 2 * self._num_nodes + 1024:
            self._compact(tier)

    def _compact(self, tier: Tier) -> None:
        bit = _TIER_BIT[tier]
        kept = []
        for entry in self._heaps[tier]:
            if self._is_candidate(entry[2], tier):
                kept.append(entry)
            else:
                entry[2]._queued &= ~bit
        heapq.heapify(kept)
        self._heaps[tier] = kept

    def _pop_candidate(self, tier: Tier) -> RadixNode | None:
        heap = self._heaps[tier]
        bit = _TIER_BIT[tier]
        while heap:
            key, _, node = heap[0]
            if not self._is_candidate(node, tier):
                heapq.heappop(heap)
                node._queued &= ~bit
            elif node.last_access != key:
                heapq.heapreplace(heap, (node.last_access, next(self._seq), node))
            else:
                heapq.heappop(heap)
                node._queued &= ~bit
                return node
        return None

    # ---- integrity -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        bs = self.block_size
        cached = dict.fromkeys(Tier, 0)
        evictable = dict.fromkeys(Tier, 0)
        seen: dict[Tier, set[int]] = {tier: set() for tier in Tier}
        num_nodes = 0
        for salt, root in self._roots.items():
            _require(root.is_root and root.parent is None, f"root of salt {salt!r} is malformed")
            _require(not root.blocks and not root.hashes, "a root must hold no blocks")
            _require(
                root.last_hash() == root_hash(salt, self.model),
                f"root seed of salt {salt!r} is wrong",
            )
            stack = [root]
            while stack:
                node = stack.pop()
                child_locks = 0
                for key, child in node.children.items():
                    stack.append(child)
                    child_locks += child.lock_count
                    _require(child._alive, "a removed node is still linked")
                    _require(child.parent is node, "child.parent does not point at its parent")
                    _require(key == child.tokens[:bs].tobytes(), "child keyed by wrong tokens")
                _require(node.lock_count >= child_locks, f"lock count too low at {node!r}")
                if node.is_root:
                    continue
                num_nodes += 1
                self._check_node(node, seen, cached, evictable)
        _require(num_nodes == self._num_nodes, "node count drifted")
        for tier in Tier:
            _require(cached[tier] == self._cached[tier], f"cached {tier} block count drifted")
            _require(evictable[tier] == self._evictable[tier], f"evictable {tier} count drifted")

    def _check_node(
        self,
        node: RadixNode,
        seen: dict[Tier, set[int]],
        cached: dict[Tier, int],
        evictable: dict[Tier, int],
    ) -> None:
        bs = self.block_size
        parent = node.parent
        assert parent is not None
        nb = len(node.tokens) // bs
        _require(nb > 0 and len(node.tokens) == nb * bs, f"edge not whole blocks at {node!r}")
        _require(node.depth_tokens == parent.depth_tokens + len(node.tokens), "depth drifted")
        _require(bool(node.blocks), f"node without any copy at {node!r}")
        _require(node.lock_count >= 0, f"negative lock count at {node!r}")
        if node.lock_count:
            _require(Tier.DEVICE in node.blocks, f"locked node lacks a device copy: {node!r}")
        expected = chain_bytes(parent.last_hash(), int32_bytes(node.tokens), bs)
        _require(node.hashes == expected, f"chained hashes are wrong at {node!r}")
        for tier, ids in node.blocks.items():
            _require(len(ids) == nb, f"{tier} copy has {len(ids)} blocks, edge has {nb}")
            pool = self.pools.get(tier)
            _require(pool is not None, f"copy in unconfigured tier {tier}")
            assert pool is not None
            for b in ids:
                _require(b not in seen[tier], f"{tier} block {b} indexed twice")
                seen[tier].add(b)
                _require(pool.refcount(b) >= 1, f"{tier} block {b} indexed but free")
            cached[tier] += nb
            if node.lock_count == 0:
                evictable[tier] += nb
            if self._is_candidate(node, tier):
                _require(node._queued & _TIER_BIT[tier] != 0, f"candidate not queued: {node!r}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
