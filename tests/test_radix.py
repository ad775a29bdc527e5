from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.memory import BlockPool, InsertResult, RadixCache, Tier, chain_hashes


def make_cache(
    block_size: int = 16, device: int = 64, host: int = 0
) -> tuple[RadixCache, BlockPool]:
    pools = {Tier.DEVICE: BlockPool(device)}
    if host:
        pools[Tier.HOST] = BlockPool(host, Tier.HOST)
    return RadixCache(block_size, pools), pools[Tier.DEVICE]


def put(
    cache: RadixCache, pool: BlockPool, tokens: list[int], salt: str | None = None
) -> InsertResult:
    """Insert as a finished request does: the cache keeps its references, the caller drops its."""
    blocks = pool.allocate(len(tokens) // cache.block_size)
    result = cache.insert(tokens, blocks, salt)
    pool.free(blocks)
    return result


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_match_is_block_aligned() -> None:
    cache, pool = make_cache(16)
    tokens = seq(0, 112)
    put(cache, pool, tokens)
    result = cache.match([*tokens[:100], 7777, 7778])
    assert result.num_tokens == 96
    assert len(result.blocks()) == 6


def test_partial_tail_never_matches() -> None:
    cache, pool = make_cache(16)
    tokens = seq(0, 32)
    put(cache, pool, tokens)
    assert cache.match(tokens[:31]).num_tokens == 16
    assert cache.match(tokens[:15]).num_tokens == 0
    assert cache.match(tokens).num_tokens == 32


def test_match_splits_node_at_block_boundary() -> None:
    cache, pool = make_cache(4)
    tokens = seq(0, 16)
    whole = put(cache, pool, tokens).node
    result = cache.match([*tokens[:10], 99, 99])
    assert result.num_tokens == 8
    upper = result.node
    assert upper.depth_tokens == 8 and upper.num_blocks == 2
    assert whole.parent is upper and whole.depth_tokens == 16 and whole.num_blocks == 2
    assert upper.blocks[Tier.DEVICE] + whole.blocks[Tier.DEVICE] == cache.match(tokens).blocks()
    assert cache.num_nodes == 2
    cache.check_invariants()


def test_insert_dedupes_existing_prefix_and_returns_canonical_blocks() -> None:
    cache, pool = make_cache(4)
    first = pool.allocate(4)
    cache.insert(seq(0, 16), first)
    second = pool.allocate(4)
    result = cache.insert([*seq(0, 8), *seq(100, 8)], second)
    assert result.blocks == first[:2] + second[2:]
    assert result.num_new_blocks == 2
    assert [pool.refcount(b) for b in second] == [1, 1, 2, 2]
    assert [pool.refcount(b) for b in first] == [2, 2, 2, 2]
    assert result.node.depth_tokens == 16
    assert cache.stats.inserted_blocks == 6
    cache.check_invariants()


def test_insert_of_an_already_cached_sequence_takes_nothing() -> None:
    cache, pool = make_cache(4)
    first = put(cache, pool, seq(0, 12))
    again = pool.allocate(3)
    result = cache.insert(seq(0, 12), again)
    assert result.num_new_blocks == 0 and result.blocks == first.blocks
    assert result.node is first.node
    assert all(pool.refcount(b) == 1 for b in again)


def test_insert_rejects_tokens_not_matching_blocks() -> None:
    cache, pool = make_cache(4)
    with pytest.raises(ValueError, match="exactly"):
        cache.insert(seq(0, 10), pool.allocate(2))


@pytest.mark.parametrize("read_before_split", [False, True])
def test_node_hashes_are_the_chained_block_hashes_across_splits(read_before_split: bool) -> None:
    cache, pool = make_cache(4)
    tokens = seq(0, 24)
    leaf = put(cache, pool, tokens, salt="t").node
    if read_before_split:
        assert leaf.hashes == b"".join(chain_hashes(tokens, 4, salt="t"))
    cache.match([*tokens[:12], 5, 5, 5, 5], salt="t")
    path = cache.match(tokens, salt="t").path
    assert len(path) == 2
    assert b"".join(node.hashes for node in path) == b"".join(chain_hashes(tokens, 4, salt="t"))
    assert path[-1].last_hash() == chain_hashes(tokens, 4, salt="t")[-1]
    assert cache.root("t").hashes == b""


def test_eviction_frees_only_the_blocks_it_needs_from_a_long_leaf() -> None:
    cache, pool = make_cache(4)
    tokens = seq(0, 32)
    put(cache, pool, tokens)
    assert cache.evict(3) == 3
    assert cache.match(tokens).num_tokens == 20
    assert cache.cached_blocks() == 5
    cache.check_invariants()


def test_eviction_is_leaf_first_lru() -> None:
    cache, pool = make_cache(4)
    prompt = seq(0, 8)
    turns = {"a": seq(100, 4), "b": seq(200, 4), "c": seq(300, 4)}
    nodes = {name: put(cache, pool, [*prompt, *turn]).node for name, turn in turns.items()}
    nodes["prompt"] = nodes["a"].parent
    for name in ["b", "c", "a"]:
        cache.match([*prompt, *turns[name]])
    order = []
    while cache.evict(1):
        order += [name for name, node in nodes.items() if not node.alive and name not in order]
    assert order == ["b", "c", "a", "prompt"]
    assert cache.stats.evicted_blocks == 5
    assert pool.num_free == pool.num_blocks


def test_internal_node_is_never_evicted_before_its_children() -> None:
    cache, pool = make_cache(4)
    child = put(cache, pool, seq(0, 8)).node
    put(cache, pool, [*seq(0, 4), 50, 51, 52, 53])
    parent = child.parent
    parent.last_access = -1.0
    assert cache.evict(1) == 1
    assert parent.alive and cache.cached_blocks() == 2


def test_parent_becomes_evictable_when_last_child_goes() -> None:
    cache, pool = make_cache(4)
    first = put(cache, pool, seq(0, 8)).node
    second = put(cache, pool, [*seq(0, 4), 50, 51, 52, 53]).node
    parent = first.parent
    parent.last_access = -1.0
    assert cache.evict(2) == 2
    assert not first.alive and not second.alive and parent.alive
    assert cache.evict(1) == 1
    assert not parent.alive and cache.cached_blocks() == 0


def test_eviction_never_touches_locked_nodes() -> None:
    cache, pool = make_cache(4)
    locked = put(cache, pool, seq(0, 12)).node
    put(cache, pool, seq(100, 8))
    cache.lock(locked)
    assert cache.evictable_blocks() == 2
    assert cache.evict(100) == 2
    assert locked.alive and cache.cached_blocks() == 3
    with pytest.raises(ValueError, match="locked"):
        cache.drop_copy(locked, Tier.DEVICE)
    cache.unlock(locked)
    assert cache.evictable_blocks() == 3
    assert cache.evict(100) == 3 and not locked.alive


def test_lock_counts_cover_every_ancestor() -> None:
    cache, pool = make_cache(4)
    leaf = put(cache, pool, seq(0, 8)).node
    upper = cache.match(seq(0, 5)).node
    cache.lock(leaf)
    cache.lock(upper)
    assert (leaf.lock_count, upper.lock_count, cache.root().lock_count) == (1, 2, 2)
    cache.unlock(leaf)
    cache.unlock(upper)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(upper)


def test_lock_checks_the_path_up_to_the_first_locked_node() -> None:
    """lock stops checking device copies at the first locked node (its path keeps them);
    below it, an unlocked ancestor without one still makes lock raise, changing nothing."""
    cache, pool = make_cache(4, host=8)
    upper = put(cache, pool, seq(0, 8)).node
    leaf = put(cache, pool, seq(0, 16)).node
    cache.add_copy(upper, Tier.HOST, cache.pools[Tier.HOST].allocate(2))
    cache.drop_copy(upper, Tier.DEVICE)  # upper: host only; leaf below it: device
    before = cache.evictable_blocks(), cache.evictable_blocks(Tier.HOST)
    with pytest.raises(ValueError, match="no device copy"):
        cache.lock(leaf)
    assert (leaf.lock_count, upper.lock_count, cache.root().lock_count) == (0, 0, 0)
    assert (cache.evictable_blocks(), cache.evictable_blocks(Tier.HOST)) == before
    top = put(cache, pool, seq(100, 8)).node
    deeper = put(cache, pool, seq(100, 16)).node
    cache.lock(top)
    cache.lock(deeper)
    assert (deeper.lock_count, top.lock_count) == (1, 2)
    assert cache.evictable_blocks() == 2  # leaf's two device blocks
    cache.unlock(top)
    assert cache.evictable_blocks() == 2
    cache.unlock(deeper)
    assert cache.evictable_blocks() == 6
    cache.check_invariants()


def test_evict_returns_what_it_could_free_when_short() -> None:
    cache, pool = make_cache(4)
    put(cache, pool, seq(0, 8))
    assert cache.evict(10) == 2
    assert cache.evict(10) == 0


def test_salts_never_share_prefixes() -> None:
    cache, pool = make_cache(4)
    tokens = seq(0, 16)
    put(cache, pool, tokens, salt="tenant-a")
    assert cache.match(tokens, salt="tenant-b").num_tokens == 0
    assert cache.match(tokens).num_tokens == 0
    assert cache.match(tokens, salt="tenant-a").num_tokens == 16
    result = put(cache, pool, tokens, salt="tenant-b")
    assert result.num_new_blocks == 4
    assert cache.root("tenant-a") is not cache.root("tenant-b")


def test_match_records_stats_only_when_asked() -> None:
    cache, pool = make_cache(4)
    put(cache, pool, seq(0, 8))
    cache.match(seq(0, 10))
    cache.match(seq(0, 10), record=False)
    assert (cache.stats.queried_tokens, cache.stats.hit_tokens) == (10, 8)
    assert cache.stats.hit_rate == pytest.approx(0.8)


def test_match_touches_last_access_along_the_path() -> None:
    ticks = itertools.count()
    pools = {Tier.DEVICE: BlockPool(16)}
    cache = RadixCache(4, pools, clock=lambda: float(next(ticks)))
    put(cache, pools[Tier.DEVICE], seq(0, 8))
    put(cache, pools[Tier.DEVICE], [*seq(0, 4), 9, 9, 9, 9])
    result = cache.match(seq(0, 8))
    assert {node.last_access for node in result.path} == {float(next(ticks)) - 1}


def test_add_copy_and_drop_copy_account_blocks_per_tier() -> None:
    cache, pool = make_cache(4, host=8)
    host = cache.pools[Tier.HOST]
    node = put(cache, pool, seq(0, 12)).node
    cache.add_copy(node, Tier.HOST, host.allocate(3))
    assert cache.cached_blocks(Tier.HOST) == 3 and cache.evictable_blocks(Tier.HOST) == 3
    with pytest.raises(ValueError, match="already"):
        cache.add_copy(node, Tier.HOST, [0, 1, 2])
    cache.check_invariants()
    cache.drop_copy(node, Tier.HOST)
    assert cache.cached_blocks(Tier.HOST) == 0 and host.num_free == 8
    assert node.alive and cache.cached_blocks() == 3


def test_host_copy_survives_device_eviction_and_matches_only_with_any_tier() -> None:
    cache, pool = make_cache(4, host=8)
    node = put(cache, pool, seq(0, 8)).node
    host_blocks = cache.pools[Tier.HOST].allocate(2)
    cache.add_copy(node, Tier.HOST, host_blocks)
    assert cache.evict(100) == 2
    assert node.alive and Tier.DEVICE not in node.blocks
    assert cache.match(seq(0, 8)).num_tokens == 0
    anywhere = cache.match(seq(0, 8), tier=None)
    assert anywhere.num_tokens == 8
    assert anywhere.residency() == [frozenset({Tier.HOST})] * 2
    assert anywhere.blocks(Tier.HOST) == host_blocks
    with pytest.raises(ValueError, match="no device copy"):
        anywhere.blocks(Tier.DEVICE)
    with pytest.raises(ValueError, match="device copy"):
        cache.lock(node)
    cache.check_invariants()


def test_insert_adopts_caller_blocks_where_tree_has_no_device_copy() -> None:
    cache, pool = make_cache(4, host=8)
    node = put(cache, pool, seq(0, 8)).node
    cache.add_copy(node, Tier.HOST, cache.pools[Tier.HOST].allocate(2))
    cache.evict(100)
    fresh = pool.allocate(2)
    result = cache.insert(seq(0, 8), fresh)
    assert result.blocks == fresh and result.num_new_blocks == 2
    assert node.blocks[Tier.DEVICE] == fresh
    assert cache.match(seq(0, 8)).num_tokens == 8
    cache.check_invariants()


def test_node_left_without_any_copy_is_removed_with_its_subtree() -> None:
    cache, pool = make_cache(4, host=8)
    host = cache.pools[Tier.HOST]
    leaf = put(cache, pool, seq(0, 8)).node
    upper = cache.match(seq(0, 4)).node
    cache.add_copy(leaf, Tier.HOST, host.allocate(1))
    cache.drop_copy(upper, Tier.DEVICE)
    assert not upper.alive and not leaf.alive
    assert pool.num_free == pool.num_blocks and host.num_free == host.num_blocks
    assert cache.cached_blocks() == cache.cached_blocks(Tier.HOST) == 0
    cache.check_invariants()


def test_check_invariants_catches_corrupted_lock_count() -> None:
    cache, pool = make_cache(4)
    node = put(cache, pool, seq(0, 8)).node
    cache.check_invariants()
    node.lock_count = 1
    with pytest.raises(AssertionError):
        cache.check_invariants()


def test_check_invariants_catches_indexed_block_that_is_free() -> None:
    cache, pool = make_cache(4)
    node = put(cache, pool, seq(0, 8)).node
    pool.decref(node.blocks[Tier.DEVICE][0])
    with pytest.raises(AssertionError, match="indexed but free"):
        cache.check_invariants()


sequences = st.lists(st.integers(0, 2), min_size=0, max_size=14)


@settings(max_examples=60, deadline=None)
@given(st.lists(sequences, max_size=8), st.lists(sequences, max_size=8))
def test_match_finds_longest_inserted_block_aligned_prefix(
    inserted: list[list[int]], queries: list[list[int]]
) -> None:
    bs = 2
    cache, pool = make_cache(bs, device=64)
    canonical: dict[tuple[int, ...], int] = {}
    for tokens in inserted:
        tokens = tokens[: len(tokens) // bs * bs]
        result = put(cache, pool, tokens)
        for i, block in enumerate(result.blocks):
            assert canonical.setdefault(tuple(tokens[: (i + 1) * bs]), block) == block
        cache.check_invariants()
    for query in queries + inserted:
        full = len(query) // bs
        expected = 0
        while expected < full and tuple(query[: (expected + 1) * bs]) in canonical:
            expected += 1
        result = cache.match(query)
        assert result.num_tokens == expected * bs
        assert result.blocks() == [canonical[tuple(query[: (i + 1) * bs])] for i in range(expected)]
        assert result.node.depth_tokens == result.num_tokens
        cache.check_invariants()


def test_extend_leaf_grows_only_a_leaf_with_a_single_lock_and_device_copy() -> None:
    cache, pool = make_cache(4, host=8)
    leaf = put(cache, pool, seq(0, 8)).node
    more = pool.allocate(1)
    assert not cache.extend_leaf(leaf, seq(8, 4), more)
    cache.lock(leaf)
    assert cache.extend_leaf(leaf, seq(8, 4), more)
    assert leaf.depth_tokens == 12 and cache.match(seq(0, 12)).num_tokens == 12
    assert leaf.hashes == b"".join(chain_hashes(seq(0, 12), 4))
    cache.lock(leaf)
    assert not cache.extend_leaf(leaf, seq(12, 4), pool.allocate(1))
    cache.unlock(leaf)
    cache.add_copy(leaf, Tier.HOST, cache.pools[Tier.HOST].allocate(3))
    assert not cache.extend_leaf(leaf, seq(12, 4), pool.allocate(1))
    cache.unlock(leaf)
    cache.check_invariants()


def test_partial_eviction_of_a_node_with_another_copy_splits_it() -> None:
    cache, pool = make_cache(4, host=8)
    node = put(cache, pool, seq(0, 8)).node
    cache.add_copy(node, Tier.HOST, cache.pools[Tier.HOST].allocate(2))
    assert cache.evict(1) == 1
    assert cache.match(seq(0, 8)).num_tokens == 4
    both = frozenset({Tier.DEVICE, Tier.HOST})
    assert cache.match(seq(0, 8), tier=None).residency() == [both, frozenset({Tier.HOST})]
    cache.check_invariants()


def filled_tree(
    inserted: list[list[int]], host_every: int, *, host_only_odd: bool = False
) -> RadixCache:
    """A block-size-2 cache holding ``inserted`` (cut to whole blocks); every
    ``host_every``-th node also gets a host copy (and, with ``host_only_odd``, the odd ones
    of those lose their device copy)."""
    radix, device = make_cache(block_size=2, device=200, host=200)
    for tokens in inserted:
        full = tokens[: len(tokens) // 2 * 2]
        radix.insert(full, device.allocate(len(full) // 2))
    for i, node in enumerate(list(radix.iter_nodes())):
        if not node.is_root and host_every and i % host_every == 0:
            radix.add_copy(node, Tier.HOST, radix.pools[Tier.HOST].allocate(node.num_blocks))
            if host_only_odd and i % 2:
                radix.drop_copy(node, Tier.DEVICE)
    return radix


@given(
    st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=16), min_size=1, max_size=6),
    st.lists(st.integers(0, 2), max_size=20),
    st.integers(0, 5),
)
def test_peek_counts_what_a_match_finds_without_touching_the_tree(
    inserted: list[list[int]], query: list[int], host_every: int
) -> None:
    radix = filled_tree(inserted, host_every)
    seen = {id(n): (n.last_access, len(n.children)) for n in radix.iter_nodes()}
    stats = (radix.stats.queried_tokens, radix.stats.hit_tokens)
    peek = radix.peek(query, None)
    assert {id(n): (n.last_access, len(n.children)) for n in radix.iter_nodes()} == seen
    assert (radix.stats.queried_tokens, radix.stats.hit_tokens) == stats
    match = radix.match(query, None, record=False, tier=None)
    expected = dict.fromkeys(Tier, 0)
    for tiers in match.residency():
        for tier in tiers:
            expected[tier] += 1
    assert peek.blocks_by_tier == expected
    assert peek.num_tokens == match.num_tokens
    assert radix.peek(query, "another salt").num_tokens == 0


def tree_shape(radix: RadixCache) -> list[tuple[int, float, tuple[str, ...], int]]:
    return sorted(
        (n.depth_tokens, n.last_access, tuple(sorted(n.blocks)), len(n.children))
        for n in radix.iter_nodes()
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=16), min_size=1, max_size=6),
    st.integers(0, 5),
    st.lists(st.integers(0, 2), max_size=6),
    st.integers(0, 20),
    st.integers(0, 5),
    st.sampled_from([Tier.DEVICE, None]),
)
def test_a_match_or_peek_below_a_known_node_is_the_one_from_the_root(
    inserted: list[list[int]],
    pick: int,
    extra: list[int],
    known: int,
    host_every: int,
    tier: Tier | None,
) -> None:
    """Given a node on the query's path (a trajectory's locked node), a match or a peek takes
    that path without comparing tokens: same result, same access times, same splits."""
    query = inserted[pick % len(inserted)] + extra
    caches = []
    for _ in range(2):
        radix = filled_tree(inserted, host_every, host_only_odd=True)
        # The node a trajectory on this query would lock: the match of a prefix of it.
        node = radix.match(query[:known], record=False, tier=None).node
        caches.append((radix, node))
    (fast, below), (slow, _) = caches
    assert fast.peek(query, below=below) == slow.peek(query)
    got = fast.match(query, record=False, tier=tier, below=below)
    want = slow.match(query, record=False, tier=tier)
    assert got.num_tokens == want.num_tokens
    assert [n.depth_tokens for n in got.path] == [n.depth_tokens for n in want.path]
    assert got.residency() == want.residency()
    assert tree_shape(fast) == tree_shape(slow)
    fast.check_invariants()


@settings(deadline=None, max_examples=100)
@given(
    seqs=st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=12), min_size=1, max_size=4),
    query=st.lists(st.integers(0, 2), max_size=14),
    length=st.integers(0, 16),
)
def test_match_of_a_length_is_match_of_the_slice(
    seqs: list[list[int]], query: list[int], length: int
) -> None:
    """`match(tokens, length=k)` (reuse_prefix's no-copy form) finds, splits and refreshes
    exactly what `match(tokens[:k])` does."""
    caches = []
    for _ in range(2):
        pool = BlockPool(64)
        cache = RadixCache(2, {Tier.DEVICE: pool})
        for seq in seqs:
            n = len(seq) // 2
            blocks = pool.allocate(n)
            cache.insert(seq[: 2 * n], blocks)
            pool.free(blocks)
        caches.append(cache)
    a = caches[0].match(query, length=length)
    b = caches[1].match(query[:length])
    assert (a.num_tokens, a.node.depth_tokens, a.blocks()) == (
        b.num_tokens,
        b.node.depth_tokens,
        b.blocks(),
    )
    assert caches[0].stats == caches[1].stats
    dump = [
        [(n.depth_tokens, bytes(n.tokens), n.last_access) for n in c.iter_nodes()] for c in caches
    ]
    assert dump[0] == dump[1]


@settings(deadline=None, max_examples=100)
@given(
    st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=16), min_size=1, max_size=6),
    st.lists(st.integers(0, 2), max_size=20),
    st.integers(0, 22),
    st.integers(0, 5),
)
def test_peek_of_a_length_is_peek_of_the_slice(
    inserted: list[list[int]], query: list[int], length: int, host_every: int
) -> None:
    radix = filled_tree(inserted, host_every, host_only_odd=True)
    assert radix.peek(query, length=length) == radix.peek(query[:length])
