"""Eviction's fast path (a tail trim requeues its leaf in place, `EvictionQueues.requeue_top`,
whose checks `RadixEviction.evict` makes inline; a top found fresh skips `peek`) evicts the
same blocks in the same order as popping the leaf and pushing it back.

A reference cache runs the eviction loop the plain way (pop, trim, push) next to the real one;
both get the same random inserts, matches, locks and evictions on a coarse clock (access-time
ties are where the queue's order of insertion decides), and must stay identical.
"""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpilot.memory import BlockPool, RadixCache, RadixNode, Tier
from kvpilot.memory.hashing import HASH_BYTES

BS = 2


class PopPushCache(RadixCache):
    """`RadixCache` whose eviction pops every candidate and pushes a trimmed leaf back."""

    def evict(self, num_blocks: int, tier: Tier = Tier.DEVICE) -> int:
        freed = 0
        while freed < num_blocks:
            node = self._queues.pop(tier)
            if node is None:
                break
            want = num_blocks - freed
            if node.num_blocks > want:
                if not node.children and len(node.blocks) == 1:
                    freed += self._trim_popped(node, tier, want)
                    continue
                self._split(node, node.num_blocks - want)
            freed += self._release(node, tier)
            freed += self._after_release(node, tier)
        self.stats.evicted_blocks += freed
        return freed

    def _trim_popped(self, node: RadixNode, tier: Tier, n: int) -> int:
        ids = node.blocks[tier]
        tail = ids[-n:]
        del ids[-n:]
        del node.tokens[-n * self.block_size :]
        if node._hashes is not None:
            node._hashes = node._hashes[: -n * HASH_BYTES]
        node.depth_tokens -= n * self.block_size
        self._tally[tier].evictable -= n
        self._push(node, tier)
        return self.pools[tier].decref_many(tail)


def dump(cache: RadixCache) -> list[Any]:
    out: list[Any] = []
    stack = [(cache.root(None), 0)]
    while stack:
        node, depth = stack.pop()
        out.append((depth, bytes(node.tokens), dict(node.blocks), node.last_access))
        stack.extend((node.children[key], depth + 1) for key in sorted(node.children))
    return out


op = st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 3), st.integers(1, 6)),
    st.tuples(st.just("insert"), st.integers(0, 3), st.integers(2, 4)),
    st.tuples(st.just("evict"), st.integers(1, 2), st.just(0)),
    st.tuples(st.just("match"), st.integers(0, 3), st.integers(1, 6)),
    st.tuples(st.just("evict"), st.integers(1, 4), st.just(0)),
    st.tuples(st.just("lock"), st.integers(0, 3), st.integers(1, 6)),
    st.tuples(st.just("unlock"), st.just(0), st.just(0)),
    st.tuples(st.just("tick"), st.integers(0, 1), st.just(0)),
)


@settings(deadline=None, max_examples=300)
@example(  # two leaves of one access time: each trim sends its leaf behind the other
    ops=[("insert", 0, 2), ("insert", 1, 2), ("evict", 1, 0), ("evict", 1, 0)], tails=[0] * 24
)
@example(  # the top's right child ties with it while its left one is newer (heap[2] decides)
    ops=[
        ("insert", 1, 3),
        ("insert", 2, 2),
        ("insert", 0, 1),
        ("evict", 1, 0),
        ("evict", 1, 0),
        ("tick", 1, 0),
        ("insert", 0, 1),
        ("evict", 1, 0),
        ("evict", 1, 0),
    ],
    tails=[0] * 24,
)
@given(ops=st.lists(op, max_size=60), tails=st.lists(st.integers(0, 9), min_size=24, max_size=24))
def test_requeued_trims_evict_like_pop_and_push(
    ops: list[tuple[str, int, int]], tails: list[int]
) -> None:
    now = [0.0]
    caches: list[tuple[RadixCache, BlockPool, list[RadixNode]]] = []
    for cls in (RadixCache, PopPushCache):
        pool = BlockPool(12)
        caches.append((cls(BS, {Tier.DEVICE: pool}, clock=lambda: now[0]), pool, []))
    for kind, a, b in ops:
        # Four families of sequences: a shared head, then one of four tails.
        tokens = [1, 2, 3, 4] + [100 * a + t for t in tails[: b * BS]]
        results = []
        for cache, pool, locks in caches:
            if kind == "insert":
                need = len(tokens) // BS
                if pool.num_free < need:
                    cache.evict(need - pool.num_free)
                if pool.num_free >= need:
                    blocks = pool.allocate(need)
                    cache.insert(tokens, blocks)
                    pool.free(blocks)
            elif kind == "match":
                results.append(cache.match(tokens).num_tokens)
            elif kind == "evict":
                results.append(cache.evict(a))
            elif kind == "lock":
                node = cache.match(tokens).node
                cache.lock(node)
                locks.append(node)
            elif kind == "unlock" and locks:
                cache.unlock(locks.pop())
            elif kind == "tick":
                now[0] += a if cache is caches[-1][0] else 0
            cache.check_invariants()
        assert results[:1] == results[1:]
        fast, ref = caches
        assert dump(fast[0]) == dump(ref[0])
        assert fast[1]._free == ref[1]._free
