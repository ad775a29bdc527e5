"""`RadixCache.evict_one_for_reuse` (a full pool's one-block eviction handing the block on
with the tree's reference) gives what `evict(1)` then `pool.allocate(1)` give: the same
block, and the same tree, queue, pool and statistics after; or it says -1, and the pair
after it gives what the pair alone would. `RadixCache.evict_and_allocate(n)` likewise for
`evict(n - num_free)` then `pool.allocate(n)` (None where the pair must run)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.memory import BlockPool, KVConfig, KVManager, RadixCache, RadixNode, Tier

B = 2
STREAMS = [[1, 1, 2, 2, 3, 3, 4, 4], [1, 1, 2, 2, 5, 5], [1, 1, 6, 6, 7, 7, 8, 8], [9, 9, 1, 1]]


def build(
    prefixes: list[tuple[int, int]], locks: list[int], held: list[int], free: int = 0
) -> RadixCache:
    """A cache over a pool of 16 blocks: prefixes of `STREAMS`, some locked, some of its blocks
    also held by someone else, every other block but ``free`` taken (the pool is full)."""
    ticks = itertools.count()
    pool = BlockPool(16)
    # A coarse clock: nodes share access times, so the queue's ties (requeues) are met.
    cache = RadixCache(B, {Tier.DEVICE: pool}, clock=lambda: float(next(ticks) // 3))
    for stream, blocks in prefixes:
        tokens = STREAMS[stream][: blocks * B]
        if len(tokens) // B <= pool.num_free:
            ids = pool.allocate(len(tokens) // B)
            cache.insert(tokens, ids)
            pool.free(ids)
    all_nodes = nodes(cache)
    for i in locks:
        cache.lock(all_nodes[i % len(all_nodes)])
    cached = [b for node in all_nodes for b in node.blocks.get(Tier.DEVICE, [])]
    for i in held:
        if cached:
            pool.incref(cached[i % len(cached)])
    pool.allocate(max(0, pool.num_free - free))
    return cache


def nodes(cache: RadixCache) -> list[RadixNode]:
    return sorted(cache.iter_nodes(), key=lambda n: (n.path_tokens().tolist(), n.depth_tokens))


def label(node: RadixNode) -> tuple[object, ...]:
    return node.alive, node.depth_tokens, tuple(node.tokens), dict(node.blocks), node.lock_count


def state(cache: RadixCache) -> tuple[object, ...]:
    pool = cache.pools[Tier.DEVICE]
    heap = [(key, seq, label(node)) for key, seq, node in cache._queues._heaps[Tier.DEVICE]]
    return (
        [label(node) for node in nodes(cache)],
        heap,
        cache.block_counts(),
        cache.stats,
        list(pool._free),
        list(pool._refcounts),
    )


# Prefixes of `STREAMS` to cache (stream, length in blocks); nodes to lock or hold, by index.
PREFIXES = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4)), min_size=1, max_size=6)
NODES = st.lists(st.integers(0, 30), max_size=3)


@settings(max_examples=300, deadline=None)
@given(
    prefixes=PREFIXES,
    locks=NODES,
    held=NODES,
    rounds=st.integers(1, 6),
)
def test_evict_one_for_reuse_equals_evict_then_allocate(
    prefixes: list[tuple[int, int]], locks: list[int], held: list[int], rounds: int
) -> None:
    fast, slow = build(prefixes, locks, held), build(prefixes, locks, held)
    assert state(fast) == state(slow)
    for _ in range(rounds):
        if not slow.evict(1):
            break
        expected = slow.pools[Tier.DEVICE].allocate(1)[0]
        block = fast.evict_one_for_reuse()
        if block < 0:  # the caller does the pair (after at most `peek`'s fixes of the queue)
            fast.evict(1)
            block = fast.pools[Tier.DEVICE].allocate(1)[0]
        assert block == expected
        assert state(fast) == state(slow)
        fast.check_invariants()


@settings(max_examples=300, deadline=None)
@given(
    prefixes=PREFIXES,
    locks=NODES,
    held=NODES,
    free=st.integers(0, 3),
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
)
def test_evict_and_allocate_equals_evict_then_allocate(
    prefixes: list[tuple[int, int]], locks: list[int], held: list[int], free: int, sizes: list[int]
) -> None:
    fast, slow = build(prefixes, locks, held, free), build(prefixes, locks, held, free)
    assert state(fast) == state(slow)
    for n in sizes:
        slow_pool, fast_pool = slow.pools[Tier.DEVICE], fast.pools[Tier.DEVICE]
        short = n - slow_pool.num_free
        if short > 0:
            slow.evict(short)
        expected = slow_pool.allocate(n) if slow_pool.num_free >= n else None
        blocks = fast.evict_and_allocate(n)
        if blocks is None:  # the caller does the pair (after at most `peek`'s fixes)
            assert short > 0
            fast.evict(short)
            blocks = fast_pool.allocate(n) if fast_pool.num_free >= n else None
        assert blocks == expected
        assert state(fast) == state(slow)
        fast.check_invariants()
        if expected is None:
            break
        # Give some blocks back (the pool was full again): the next eviction starts from a
        # free list that is not empty.
        slow_pool.free(expected[: n % 3])
        fast_pool.free(blocks[: n % 3])


def test_an_admission_under_a_full_pool_trims_the_oldest_leaf_once() -> None:
    fast = build([(0, 4)], [], [], free=1)
    leaf = nodes(fast)[-1]
    tail = leaf.blocks[Tier.DEVICE][-2:]
    last_free = fast.pools[Tier.DEVICE]._free[-1]
    assert fast.evict_and_allocate(3) == [tail[1], tail[0], last_free]
    assert leaf.num_blocks == 2 and fast.stats.evicted_blocks == 2
    assert fast.pools[Tier.DEVICE].num_free == 0
    assert fast.cached_blocks() == 2 and fast.evictable_blocks() == 2
    fast.check_invariants()


def test_a_full_pool_trims_the_oldest_leaf_by_one_block_without_the_free_list() -> None:
    fast = build([(0, 4)], [], [])
    leaf = nodes(fast)[-1]
    last = leaf.blocks[Tier.DEVICE][-1]
    assert fast.evict_one_for_reuse() == last
    assert leaf.num_blocks == 3 and leaf.depth_tokens == 3 * B
    assert fast.pools[Tier.DEVICE].refcount(last) == 1 and fast.stats.evicted_blocks == 1
    assert fast.cached_blocks() == 3 and fast.evictable_blocks() == 3


def test_nothing_changes_where_the_pair_would_do_more() -> None:
    """A one-block leaf goes whole, a block someone else holds frees nothing, a hook must see
    the block freed: the caller is told -1 and does the pair."""
    one = build([(3, 1)], [], [])
    assert one.evict_one_for_reuse() == -1
    shared = build([(0, 4)], [], [3])
    assert shared.evict_one_for_reuse() == -1
    hooked = build([(0, 4)], [], [])
    hooked.pools[Tier.DEVICE].on_free = lambda blocks: None
    before = state(hooked)
    assert hooked.evict_one_for_reuse() == -1
    assert state(hooked) == before


def test_a_trajectory_under_a_full_pool_takes_the_block_either_way() -> None:
    """`Trajectory.allocate` of one block with no free block: through the one call where it
    applies, through evict-then-allocate where the oldest leaf is one block long."""
    kv = KVManager(KVConfig(block_size=B, num_device_blocks=4))
    old = kv.open_trajectory(tokens=[1] * B)  # one cached block, then unlocked
    old.allocate(B)
    old.mark_computed(B)
    cached = old.block_table[0]
    old.close()
    busy = kv.open_trajectory(tokens=[5] * (3 * B))
    busy.allocate(3 * B)
    busy.mark_computed(3 * B)
    busy.commit()  # the pool is full: three blocks locked, one cached
    assert kv.device.num_free == 0
    busy.append_token(5)
    busy.allocate(1)  # the oldest leaf is one block: evicted whole, its block reused
    assert busy.block_table[-1] == cached and kv.radix.cached_blocks() == 3
    kv.check_invariants()
    other = kv.open_trajectory(tokens=[5] * (3 * B) + [6])
    other.reuse_prefix()
    busy.close()  # the three-block path is cached, locked by ``other`` alone
    other.release_kv(keep_in_cache=True)
    assert kv.device.num_free == 1
    kv.device.allocate(1)  # full again
    again = kv.open_trajectory(tokens=[7])

    def no_evict(*args: object, **kwargs: object) -> int:
        raise AssertionError("the one call should have taken the block")

    kv.radix.evict = no_evict  # type: ignore[method-assign]
    again.allocate(1)  # trims the three-block leaf's last block through the one call
    assert kv.radix.cached_blocks() == 2 and kv.radix.stats.evicted_blocks == 2
    kv.radix.check_invariants()  # (the block taken by hand is no holder's: no manager audit)


def test_a_trajectory_admitted_under_a_full_pool_takes_its_blocks_in_one_call() -> None:
    """`Trajectory.allocate` of several blocks with too few free: the trimmed blocks of the
    oldest leaf, last first, then the free ones, without `evict`; the pair where the oldest
    leaf is too short for one trim."""
    kv = KVManager(KVConfig(block_size=B, num_device_blocks=8))
    old = kv.open_trajectory(tokens=[1] * (5 * B))
    old.allocate(5 * B)
    old.mark_computed(5 * B)
    cached = list(old.block_table)
    old.close()  # five cached blocks, unlocked
    kv.device.allocate(2)  # one block left free
    free = kv.device._free[-1]

    def no_evict(*args: object, **kwargs: object) -> int:
        raise AssertionError("the one call should have taken the blocks")

    kv.radix.evict = no_evict  # type: ignore[method-assign]
    new = kv.open_trajectory(tokens=[2] * (3 * B))
    new.allocate(3 * B)
    assert new.block_table == [cached[4], cached[3], free]
    assert kv.radix.cached_blocks() == 3 and kv.radix.stats.evicted_blocks == 2
    del kv.radix.evict  # the class's again
    other = kv.open_trajectory(tokens=[3] * (3 * B))
    other.allocate(3 * B)  # the leaf holds three: evicted whole, through the pair
    assert other.block_table == [cached[2], cached[1], cached[0]]
    assert kv.radix.cached_blocks() == 0 and kv.device.num_free == 0


def test_a_fresh_top_entry_whose_node_gained_a_child_is_not_trimmed() -> None:
    """The fast paths' hot test takes a fresh top entry for the candidate only when its node
    has no children: a leaf queued, then extended below at the same access time, is no longer
    one (its child is), and both paths give what the pair gives."""
    for reuse in (True, False):
        caches = []
        for _ in range(2):
            pool = BlockPool(6)
            cache = RadixCache(B, {Tier.DEVICE: pool}, clock=lambda: 0.0)
            for tokens in (STREAMS[0][:4], STREAMS[0]):  # 2 blocks, then 2 more below them
                ids = pool.allocate(len(tokens) // B)
                cache.insert(tokens, ids)
                pool.free(ids)
            pool.allocate(pool.num_free)  # full
            caches.append(cache)
        fast, slow = caches
        top = fast._device_heap[0][2]
        assert top.children and top.last_access == fast._device_heap[0][0]
        slow.evict(1)
        expected = slow.pools[Tier.DEVICE].allocate(1)
        got = [fast.evict_one_for_reuse()] if reuse else fast.evict_and_allocate(1)
        assert got == expected
        assert state(fast) == state(slow)
        fast.check_invariants()
