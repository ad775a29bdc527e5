"""`RadixCache.relock` (moving one lock, walking only the nodes whose count changes) leaves
the tree exactly as `lock` of the new node then `unlock` of the old one: every lock count,
the evictable totals, and the eviction queue's entries in order (pushes included), in
every relation between the two nodes (descendant, ancestor, cousins, two salts)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.memory import BlockPool, RadixCache, RadixNode, Tier

B = 2
STREAMS = [[1, 1, 2, 2, 3, 3, 4, 4], [1, 1, 2, 2, 5, 5], [1, 1, 6, 6, 7, 7, 8, 8], [9, 9, 1, 1]]


def build(prefixes: list[tuple[int, int, int]]) -> RadixCache:
    """A cache holding prefixes of `STREAMS` (often splitting each other), host copies on some."""
    ticks = itertools.count()
    pools = {Tier.DEVICE: BlockPool(64), Tier.HOST: BlockPool(64, Tier.HOST)}
    cache = RadixCache(B, pools, clock=lambda: float(next(ticks)))
    for stream, blocks, salt in prefixes:
        tokens = STREAMS[stream][: blocks * B]
        if tokens:
            ids = pools[Tier.DEVICE].allocate(len(tokens) // B)
            cache.insert(tokens, ids, "s" if salt else None)
            pools[Tier.DEVICE].free(ids)
    return cache


def nodes(cache: RadixCache) -> list[RadixNode]:
    return sorted(
        cache.iter_nodes(),
        key=lambda n: (n.last_hash() if n.depth_tokens else b"", n.depth_tokens),
    )


def label(node: RadixNode) -> tuple[object, ...]:
    return node.alive, node.depth_tokens, tuple(node.tokens), node.lock_count


def state(cache: RadixCache) -> tuple[object, ...]:
    heaps = {
        tier: [(key, seq, label(node)) for key, seq, node in heap]
        for tier, heap in cache._queues._heaps.items()
    }
    counts = [node.lock_count for node in nodes(cache)]
    return counts, cache.block_counts()["evictable"], heaps


prefix = st.tuples(st.integers(0, len(STREAMS) - 1), st.integers(1, 4), st.integers(0, 1))


@settings(max_examples=300, deadline=None)
@given(
    prefixes=st.lists(prefix, min_size=1, max_size=6),
    locks=st.lists(st.integers(0, 30), max_size=4),
    host=st.lists(st.integers(0, 30), max_size=3),
    old=st.integers(0, 30),
    evict=st.integers(0, 8),
    new=st.integers(0, 30),
)
def test_relock_equals_lock_then_unlock(
    prefixes: list[tuple[int, int, int]],
    locks: list[int],
    host: list[int],
    old: int,
    evict: int,
    new: int,
) -> None:
    caches = [build(prefixes), build(prefixes)]
    picked = []
    for cache in caches:
        all_nodes = nodes(cache)
        for i in host:  # a host copy on some nodes (counted as evictable in that tier too)
            node = all_nodes[i % len(all_nodes)]
            if node.depth_tokens and Tier.HOST not in node.blocks:
                cache.add_copy(node, Tier.HOST, cache.pools[Tier.HOST].allocate(node.num_blocks))
        for i in locks:
            cache.lock(all_nodes[i % len(all_nodes)])
        o = all_nodes[old % len(all_nodes)]
        cache.lock(o)  # the lock that moves
        # Eviction drops the locked nodes' queue entries: unlocking must queue them anew.
        cache.evict(evict)
        alive = [n for n in nodes(cache) if Tier.DEVICE in n.blocks or not n.depth_tokens]
        picked.append((o, alive[new % len(alive)]))
    assert state(caches[0]) == state(caches[1])
    (o0, n0), (o1, n1) = picked
    caches[0].lock(n0)
    caches[0].unlock(o0)
    caches[1].relock(o1, n1)
    assert state(caches[0]) == state(caches[1])
    caches[1].check_invariants()


def test_relock_refuses_as_lock_and_unlock_do_changing_nothing() -> None:
    cache = build([(0, 4, 0)])
    leaf = max(cache.iter_nodes(), key=lambda n: n.depth_tokens)
    root = cache.root()
    with pytest.raises(ValueError, match="not locked"):
        cache.relock(leaf, root)
    cache.lock(root)
    cache.evict(100)  # the leaf goes: locking it is refused
    assert not leaf.alive
    before = state(cache)
    with pytest.raises(ValueError, match="evicted"):
        cache.relock(root, leaf)
    assert state(cache) == before and root.lock_count == 1
    cache.check_invariants()


def test_relock_refuses_a_path_without_device_copy_changing_nothing() -> None:
    cache = build([(0, 4, 0)])
    leaf = max(cache.iter_nodes(), key=lambda n: n.depth_tokens)
    cache.add_copy(leaf, Tier.HOST, cache.pools[Tier.HOST].allocate(leaf.num_blocks))
    cache.evict(100)  # the device copy goes, the host copy stays
    assert leaf.alive and Tier.DEVICE not in leaf.blocks
    root = cache.root()
    cache.lock(root)
    before = state(cache)
    with pytest.raises(ValueError, match="device copy"):
        cache.relock(root, leaf)
    assert state(cache) == before
