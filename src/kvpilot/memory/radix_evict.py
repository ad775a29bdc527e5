"""Eviction from the radix cache: locks that shield a path from it, leaf-first LRU per tier,
and releasing a node's copies.

The order: one lazy min-heap per tier, oldest access first.
A node is a *candidate* in a tier when it holds a copy there, no trajectory or move locks
it, and no child holds a copy in that tier (leaf-first). An entry may be stale (older than
the node's true access time, or no longer a candidate) and is fixed when popped.
``node._queued`` has a bit per tier whose heap holds an entry for it; every candidate has
its bit set, so pushing twice is a no-op.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod

from kvpilot.memory.block_pool import BlockPool
from kvpilot.memory.hashing import HASH_BYTES
from kvpilot.memory.radix_node import RadixNode, RadixObserver, RadixStats, TierTally
from kvpilot.memory.tiers import Tier

TIER_BIT = {Tier.DEVICE: 1, Tier.HOST: 2, Tier.DISK: 4}


def is_candidate(node: RadixNode, tier: Tier) -> bool:
    return (
        node._alive
        and node.lock_count == 0
        and tier in node.blocks
        and node.depth_tokens != 0  # not a root
        and (not node.children or not any(tier in c.blocks for c in node.children.values()))
    )


def queue_limit(live_nodes: int) -> int:
    """The length past which a tier's queue is compacted: two entries per live node, and slack."""
    return 2 * live_nodes + 1024


class EvictionQueues:
    def __init__(self) -> None:
        self._heaps: dict[Tier, list[tuple[float, int, RadixNode]]] = {tier: [] for tier in Tier}
        self._seq = itertools.count()

    def push(self, node: RadixNode, tier: Tier, limit: int) -> None:
        """Queue ``node`` in ``tier`` if it is a candidate there and not queued yet (then
        compact the queue if longer than ``limit``, `queue_limit`)."""
        bit = TIER_BIT[tier]
        if node._queued & bit or not is_candidate(node, tier):
            return
        node._queued |= bit
        heap = self._heaps[tier]
        heapq.heappush(heap, (node.last_access, next(self._seq), node))
        if len(heap) > limit:
            self._compact(tier)

    def _compact(self, tier: Tier) -> None:
        bit = TIER_BIT[tier]
        kept = []
        for entry in self._heaps[tier]:
            if is_candidate(entry[2], tier):
                kept.append(entry)
            else:
                entry[2]._queued &= ~bit
        heapq.heapify(kept)
        self._heaps[tier][:] = kept  # in place: the device list is also `_device_heap`

    def pop(self, tier: Tier) -> RadixNode | None:
        """The least recently used candidate in ``tier`` (None when there is none)."""
        node = self.peek(tier)
        if node is not None:
            heapq.heappop(self._heaps[tier])
            node._queued &= ~TIER_BIT[tier]
        return node

    def peek(self, tier: Tier) -> RadixNode | None:
        """The least recently used candidate in ``tier``, left queued at the heap's top (None
        when there is none); stale entries above it are dropped or fixed as `pop` does."""
        heap = self._heaps[tier]
        bit = TIER_BIT[tier]
        while heap:  # hot path
            key, _, node = heap[0]
            if not (  # is_candidate, inline but for a node with children (the hot path)
                node._alive
                and not node.lock_count
                and tier in node.blocks
                and node.depth_tokens
                and (not node.children or is_candidate(node, tier))
            ):
                heapq.heappop(heap)
                node._queued &= ~bit
            elif node.last_access != key:
                heapq.heapreplace(heap, (node.last_access, next(self._seq), node))
            else:
                return node
        return None

    def requeue_top(self, tier: Tier, limit: int) -> None:
        """The candidate `peek` returned stays one: queue it anew (behind others of its access
        time), exactly as `pop` then `push` would, with one sift at most."""
        heap = self._heaps[tier]
        key = heap[0][0]
        size = len(heap)
        # While both children's keys are larger, so is every other entry's: no comparison
        # ever reaches the top's order number (later entries get larger ones anyway), so
        # leaving the entry as it is pops in the same order as a fresh one would.
        if (size > 1 and heap[1][0] <= key) or (size > 2 and heap[2][0] <= key):
            heapq.heapreplace(heap, (key, next(self._seq), heap[0][2]))
        if size > limit:
            self._compact(tier)

    @staticmethod
    def queued(node: RadixNode, tier: Tier) -> bool:
        return bool(node._queued & TIER_BIT[tier])


class RadixEviction(ABC):
    """`RadixCache`'s eviction and copy release (a base class; the cache's fields it uses are
    declared here for the type checker)."""

    block_size: int
    pools: dict[Tier, BlockPool]
    stats: RadixStats
    observer: RadixObserver | None
    _tally: dict[Tier, TierTally]  # per tier: blocks evictable and locked
    _device_tally: TierTally  # ``_tally[DEVICE]``
    _device_pool: BlockPool  # ``pools[DEVICE]``
    _device_heap: list[tuple[float, int, RadixNode]]  # ``_queues._heaps[DEVICE]``
    _num_nodes: int
    _queue_limit: int  # `queue_limit` of ``_num_nodes``, kept with it (read per eviction)
    _queues: EvictionQueues
    # The non-root nodes whose lock count crossed between 1 and 2 (or that were split while
    # locked once), for the idle-held tally (`watch_locks`); None: nobody watches.
    _lock_log: list[RadixNode] | None

    @abstractmethod
    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node``'s edge after ``k`` blocks; the new upper node is returned."""

    # ---- locks: a locked node (and its path to the root) is never evicted ---------------

    def lock(self, node: RadixNode) -> None:
        if not node._alive:
            raise ValueError("cannot lock a node that was evicted")
        self._check_lockable(node)
        self._lock_up(node, None)

    def unlock(self, node: RadixNode) -> None:
        # A node's lock count is at least any child's (check_radix), so when ``node`` is
        # locked, so is its whole path.
        if node.lock_count <= 0:
            raise ValueError(f"unlock of node at depth {node.depth_tokens} that is not locked")
        self._unlock_up(node, None)

    def relock(self, old: RadixNode, new: RadixNode) -> None:
        """Move one lock from ``old`` to ``new``: `lock` of ``new`` then `unlock` of ``old``,
        walking only the nodes whose count changes.

        The two walks meet at the deepest common ancestor; from there up, one adds what the
        other takes away (the common nodes stay locked, so neither walk changes what is
        evictable there). Below it the counts, the evictable totals and the queue pushes (in
        `unlock`'s order, from ``old`` up) are exactly those of the two calls.
        """
        if not new._alive:
            raise ValueError("cannot lock a node that was evicted")
        if old.lock_count <= 0:
            raise ValueError(f"unlock of node at depth {old.depth_tokens} that is not locked")
        a: RadixNode | None = new
        b: RadixNode | None = old
        while a is not b:  # depths strictly fall towards a root: climb the deeper side
            assert a is not None and b is not None
            if a.depth_tokens >= b.depth_tokens:
                a = a.parent
            else:
                b = b.parent
            if a is None or b is None:  # in two trees (salts): nothing is shared
                self.lock(new)
                self.unlock(old)
                return
        self._check_lockable(new)  # stops at ``a`` at the latest: it is locked
        self._lock_up(new, a)
        self._unlock_up(old, a)

    def _check_lockable(self, node: RadixNode) -> None:
        """ValueError unless ``node``'s path keeps its device copies. A locked node's path is
        locked too and keeps them (neither eviction nor `drop_copy` takes a locked node's):
        the check stops at the first locked node."""
        n: RadixNode | None = node
        while n is not None and not n.lock_count:
            if Tier.DEVICE not in n.blocks and n.depth_tokens:  # a root holds no blocks
                raise ValueError(
                    f"cannot lock: node at depth {n.depth_tokens} has no device copy; load it first"
                )
            n = n.parent

    def _lock_up(self, node: RadixNode, stop: RadixNode | None) -> None:
        """One more lock on ``node`` and its ancestors below ``stop`` (None: to the root)."""
        log = self._lock_log
        n: RadixNode | None = node
        while n is not None and n is not stop:
            if n.lock_count == 0 and n.depth_tokens:
                for tier, ids in n.blocks.items():
                    tally = self._tally[tier]
                    tally.evictable -= len(ids)
                    tally.locked += len(ids)
            n.lock_count += 1
            if n.lock_count == 2 and log is not None and n.depth_tokens:
                log.append(n)
            n = n.parent

    def _unlock_up(self, node: RadixNode, stop: RadixNode | None) -> None:
        """One lock fewer on ``node`` and its ancestors below ``stop`` (None: to the root);
        a node left unlocked is queued for eviction."""
        log = self._lock_log
        n: RadixNode | None = node
        while n is not None and n is not stop:
            n.lock_count -= 1
            if n.lock_count == 0 and n.depth_tokens:
                for tier, ids in n.blocks.items():
                    tally = self._tally[tier]
                    tally.evictable += len(ids)
                    tally.locked -= len(ids)
                    self._push(n, tier)
            elif n.lock_count == 1 and log is not None and n.depth_tokens:
                log.append(n)
            n = n.parent

    def watch_locks(self, log: list[RadixNode] | None) -> None:
        """From now on append to ``log`` every non-root node whose lock count crosses between
        1 and 2, and every node split while it has exactly one lock (the deeper part, which
        keeps its identity): what can change which blocks a lock holder holds alone
        (`engine.idle_held`). One watcher per cache; the watcher empties the log. None: stop
        watching."""
        if log is not None and self._lock_log is not None and self._lock_log is not log:
            raise ValueError("this radix cache's locks are already watched")
        self._lock_log = log

    # ---- eviction ----------------------------------------------------------------------

    def evict(self, num_blocks: int, tier: Tier = Tier.DEVICE) -> int:
        """Leaf-first LRU; returns ``tier`` blocks freed (fewer when nothing more is evictable).

        A candidate larger than what is still needed is split and only its tail blocks go, so
        freeing one block never drops a whole 2k-token turn.
        """
        freed = 0
        queues = self._queues
        heaps = queues._heaps
        pool = self.pools[tier]
        tally = self._tally[tier]
        bs = self.block_size
        while freed < num_blocks:
            want = num_blocks - freed
            heap = heaps[tier]
            if heap:
                # `peek`'s answer without the call when the top entry is a fresh childless
                # single-copy candidate, the hot path's node (else `peek` fixes the heap).
                key, _, node = heap[0]
                ids = node.blocks.get(tier)
                hot = (
                    ids is not None
                    and key == node.last_access
                    and not node.children
                    and len(node.blocks) == 1
                    and not node.lock_count
                    and node._alive
                    and node.depth_tokens
                )
            else:
                hot = False
            if not hot:
                peeked = queues.peek(tier)
                if peeked is None:
                    break
                node = peeked
                ids = node.blocks[tier]
                key = node.last_access
            assert ids is not None
            size = len(ids)
            if size > want and not node.children and len(node.blocks) == 1:
                # The hot path: trim the last ``want`` blocks of a childless single-copy leaf
                # in place (no edge copy); it stays a candidate at the top of the queue.
                if self.observer is not None:
                    self.observer.evicted(tier, node.hashes[-want * HASH_BYTES :])
                if want == 1:  # one block (a decode step's allocation): no tail list
                    tail = None
                    block = ids.pop()
                else:
                    tail = ids[-want:]
                    del ids[-want:]
                del node.tokens[-want * bs :]
                if node._hashes is not None:
                    node._hashes = node._hashes[: -want * HASH_BYTES]
                node.depth_tokens -= want * bs
                tally.evictable -= want
                # `requeue_top`, called only when it has something to do (``heap`` is the
                # tier's list: `peek` fixes it and a compaction rebuilds it, both in place)
                n = len(heap)
                if (
                    (n > 1 and heap[1][0] <= key)
                    or (n > 2 and heap[2][0] <= key)
                    or n > self._queue_limit
                ):
                    queues.requeue_top(tier, self._queue_limit)
                if tail is None:
                    freed += pool.decref_one(block)
                else:
                    freed += pool.decref_many(tail)
                continue
            queues.pop(tier)
            if size > want:
                self._split(node, size - want)
            freed += self._release(node, tier)
            freed += self._after_release(node, tier)
        self.stats.evicted_blocks += freed
        return freed

    def _release(self, node: RadixNode, tier: Tier) -> int:
        """Drop ``node``'s copy in ``tier``; returns blocks that went back to the free list."""
        if self.observer is not None:
            self.observer.evicted(tier, node.hashes)
        ids = node.blocks.pop(tier)
        if node.lock_count == 0:
            self._tally[tier].evictable -= len(ids)
        else:
            self._tally[tier].locked -= len(ids)
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
            self._queue_limit -= 2
        return freed

    def _push(self, node: RadixNode, tier: Tier) -> None:
        self._queues.push(node, tier, self._queue_limit)
