"""Eviction that hands the blocks it frees straight on (a full device pool's hot paths): a
decode step's one block, `evict_one_for_reuse`, and an admission's blocks, `evict_and_allocate`,
each equal to `evict` then the pool's `allocate` where they apply (radix_evict.py has `evict`)."""

from __future__ import annotations

from kvpilot.memory.hashing import HASH_BYTES
from kvpilot.memory.radix_evict import RadixEviction
from kvpilot.memory.tiers import DEVICE


class RadixReuse(RadixEviction):
    """`RadixCache`'s evict-then-allocate fast paths (a base class, below `RadixEviction`)."""

    def evict_one_for_reuse(self) -> int:
        """`evict(1)` then the device pool's `allocate(1)` in one step (a decode step's block
        under a full pool, the hot path): the block the eviction frees is handed on with the
        tree's reference (refcount 1 now the caller's) instead of going through the free list.

        The pair gives the same block: with the free list empty (why `evict` is called) and
        LIFO, `allocate` pops what `evict` just freed. Only for evict's trim case (the least
        recently used candidate a childless single-copy leaf of two or more blocks, its last
        block held by the tree alone) and no `on_free` hook; otherwise -1, and the caller does
        the pair: nothing changed but what `evict` does first anyway (`peek` fixing the queue's
        stale top entries, after which a `peek` changes nothing).
        """
        heap = self._device_heap
        if not heap:
            return -1
        key, _, node = heap[0]
        ids = node.blocks.get(DEVICE)
        # evict's ``hot`` test, a fresh top entry that is a childless candidate, without its
        # tests of a root or a dead node: neither is ever queued with a copy (`push` queues
        # candidates only; a node dies only after every copy was released).
        if ids is None or key != node.last_access or node.lock_count or node.children:
            peeked = self._queues.peek(DEVICE)  # as `evict` would, fixing the heap in place
            if peeked is None or peeked.children:  # none, or not a trim
                return -1
            node = peeked
            key = node.last_access
            ids = node.blocks[DEVICE]
        if len(ids) < 2 or len(node.blocks) != 1:  # not a trim
            return -1
        pool = self._device_pool
        block = ids[-1]
        if pool._refcounts[block] != 1 or pool.on_free is not None:
            return -1
        hashes = node._hashes
        if hashes is not None:  # an observed tree keeps every node's (`set_observer`)
            if self.observer is not None:
                self.observer.evicted(DEVICE, hashes[-HASH_BYTES:])
            node._hashes = hashes[:-HASH_BYTES]
        ids.pop()
        bs = self.block_size
        del node.tokens[-bs:]
        node.depth_tokens -= bs
        self._device_tally.evictable -= 1  # the leaf is unlocked
        n = len(heap)  # `requeue_top`, when it has something to do (as in `evict`)
        if (n > 1 and heap[1][0] <= key) or (n > 2 and heap[2][0] <= key) or n > self._queue_limit:
            self._queues.requeue_top(DEVICE, self._queue_limit)
        self.stats.evicted_blocks += 1
        return block

    def evict_and_allocate(self, n: int) -> list[int] | None:
        """`evict(n - num_free)` then the device pool's `allocate(n)` in one call (an admission's
        blocks under a full pool, the hot path): the trimmed blocks are handed on with the
        tree's references (refcount 1, now the caller's) instead of going through the free list.

        The pair gives the same blocks: `evict` trims the least recently used leaf's last
        ``short`` blocks, ``tail``, and `decref_many` appends them to the free list in that
        order after the ``num_free`` blocks already there; `allocate(n)` then pops all of them
        from the end (LIFO): ``reversed(tail)``, then the free list's blocks, last first.
        Only for evict's one-trim case (the candidate a childless single-copy leaf longer than
        ``short``, its last ``short`` blocks held by the tree alone) and no `on_free` hook;
        otherwise None, and the caller does the pair: nothing changed but `peek` fixing the
        queue's stale top entries, which `evict` does first anyway.
        """
        pool = self._device_pool
        short = n - len(pool._free)
        if short <= 0:
            return pool.allocate(n)
        if pool.on_free is not None:
            return None
        heap = self._device_heap
        if not heap:
            return None
        key, _, node = heap[0]  # evict's first candidate: a fresh top entry, as above
        ids = node.blocks.get(DEVICE)
        if ids is None or key != node.last_access or node.lock_count or node.children:
            peeked = self._queues.peek(DEVICE)  # as `evict` would, fixing the heap in place
            if peeked is None or peeked.children:  # none, or not a trim
                return None
            node = peeked
            key = node.last_access
            ids = node.blocks[DEVICE]
        if len(ids) <= short or len(node.blocks) != 1:  # not one trim
            return None
        tail = ids[-short:]
        refs = pool._refcounts
        for block in tail:
            if refs[block] != 1:  # someone else holds it too: `evict` would not free it
                return None
        hashes = node._hashes
        if hashes is not None:  # an observed tree keeps every node's (`set_observer`)
            if self.observer is not None:
                self.observer.evicted(DEVICE, hashes[-short * HASH_BYTES :])
            node._hashes = hashes[: -short * HASH_BYTES]
        del ids[-short:]
        del node.tokens[-short * self.block_size :]
        node.depth_tokens -= short * self.block_size
        self._device_tally.evictable -= short  # the leaf is unlocked
        size = len(heap)  # `requeue_top`, when it has something to do (as in `evict`)
        if (
            (size > 1 and heap[1][0] <= key)
            or (size > 2 and heap[2][0] <= key)
            or size > self._queue_limit
        ):
            self._queues.requeue_top(DEVICE, self._queue_limit)
        self.stats.evicted_blocks += short
        tail.reverse()
        if short < n:  # the free list's blocks follow, as `allocate` pops them
            tail += pool.allocate(n - short)
        return tail
