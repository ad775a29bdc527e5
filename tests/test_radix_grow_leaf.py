"""`RadixCache.grow_leaf` (a trajectory commit's way to grow its locked leaf, and the core of
`extend_leaf`) does exactly what the in-place growth it replaced did (`reference_grow`,
kept here as the specification): the same answer, and the same nodes, hashes, totals,
statistics and observer events after, whatever the node (a leaf locked once, locked twice,
with children, with a host copy, a root) and whether the tree keeps hashes."""

from __future__ import annotations

import itertools
from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.memory import BlockPool, RadixCache, RadixNode, Tier
from kvpilot.memory.hashing import HASH_BYTES, chain_bytes, int32_bytes

B = 2
STREAMS = [[1, 1, 2, 2, 3, 3, 4, 4], [1, 1, 2, 2, 5, 5], [1, 1, 6, 6, 7, 7, 8, 8], [9, 9, 1, 1]]


class Events:
    def __init__(self) -> None:
        self.log: list[tuple[str, object, bytes]] = []

    def committed(self, hashes: bytes) -> None:
        self.log.append(("committed", None, hashes))

    def moved(self, tier: Tier, hashes: bytes) -> None:
        self.log.append(("moved", tier, hashes))

    def evicted(self, tier: Tier, hashes: bytes) -> None:
        self.log.append(("evicted", tier, hashes))


def reference_grow(cache: RadixCache, node: RadixNode, tokens: array, blocks: list[int]) -> bool:
    """`extend_leaf(node, tokens, blocks, adopt=True)` as it was written before `grow_leaf`."""
    device = node.blocks.get(Tier.DEVICE)
    if (
        device is None
        or node.lock_count != 1
        or node.children
        or len(node.blocks) != 1
        or not node.alive
        or node.depth_tokens == 0
    ):
        return False
    if cache.observer is not None:
        node.hashes  # noqa: B018 (an observed tree keeps every node's hashes)
    if node._hashes is not None:
        new = chain_bytes(node._hashes[-HASH_BYTES:], int32_bytes(tokens), B)
        node._hashes += new
        if cache.observer is not None:
            cache.observer.committed(new)
    node.tokens.extend(tokens)
    device.extend(blocks)
    node.depth_tokens += len(blocks) * B
    node.last_access = cache._clock()
    cache._tally[Tier.DEVICE].locked += len(blocks)
    cache.stats.inserted_blocks += len(blocks)
    return True


def build(prefixes: list[int], hashed: bool, observed: bool) -> RadixCache:
    ticks = itertools.count()
    pools = {Tier.DEVICE: BlockPool(64), Tier.HOST: BlockPool(64, Tier.HOST)}
    cache = RadixCache(B, pools, clock=lambda: float(next(ticks)))
    for stream in prefixes:
        ids = pools[Tier.DEVICE].allocate(len(STREAMS[stream]) // B)
        cache.insert(STREAMS[stream], ids)
        pools[Tier.DEVICE].free(ids)
    if hashed:
        for node in cache.iter_nodes():
            node.hashes  # noqa: B018 (computed and kept)
    if observed:
        cache.set_observer(Events())
    return cache


def nodes(cache: RadixCache) -> list[RadixNode]:
    return sorted(cache.iter_nodes(), key=lambda n: (n.path_tokens().tolist(), n.depth_tokens))


def state(cache: RadixCache) -> tuple[object, ...]:
    observer = cache.observer
    return (
        [
            (n.tokens.tolist(), n.blocks, n.depth_tokens, n.last_access, n._hashes, n.lock_count)
            for n in nodes(cache)
        ],
        cache.block_counts(),
        cache.stats,
        list(cache.pools[Tier.DEVICE]._refcounts),
        observer.log if isinstance(observer, Events) else None,
    )


@settings(max_examples=200, deadline=None)
@given(
    prefixes=st.lists(st.integers(0, len(STREAMS) - 1), min_size=1, max_size=4),
    pick=st.integers(0, 30),
    locks=st.integers(0, 2),
    grow=st.integers(1, 3),
    host=st.booleans(),
    hashed=st.booleans(),
    observed=st.booleans(),
)
def test_grow_leaf_equals_the_growth_it_replaced(
    prefixes: list[int],
    pick: int,
    locks: int,
    grow: int,
    host: bool,
    hashed: bool,
    observed: bool,
) -> None:
    caches = [build(prefixes, hashed, observed) for _ in range(2)]
    answers = []
    for i, cache in enumerate(caches):
        all_nodes = nodes(cache)
        node = all_nodes[pick % len(all_nodes)]
        if host and node.depth_tokens:
            cache.add_copy(node, Tier.HOST, cache.pools[Tier.HOST].allocate(node.num_blocks))
        for _ in range(locks):
            cache.lock(node)
        blocks = cache.pools[Tier.DEVICE].allocate(grow)  # the committer's, handed over
        tokens = array("i", [100 + j for j in range(grow * B)])
        if i == 0:
            answers.append(reference_grow(cache, node, tokens, blocks))
        else:
            answers.append(cache.grow_leaf(node, tokens, blocks))
    assert answers[0] == answers[1]
    assert state(caches[0]) == state(caches[1])
