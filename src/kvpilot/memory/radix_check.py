"""The radix cache's integrity audit: tree shape, chained hashes, copies, counters, queues."""

from __future__ import annotations

from collections.abc import Mapping

from kvpilot.errors import require
from kvpilot.memory.block_pool import BlockPool
from kvpilot.memory.hashing import chain_bytes, int32_bytes, root_hash
from kvpilot.memory.radix_evict import EvictionQueues, is_candidate
from kvpilot.memory.radix_node import RadixNode
from kvpilot.memory.tiers import Tier


def check_radix(
    roots: Mapping[str | None, RadixNode],
    block_size: int,
    pools: Mapping[Tier, BlockPool],
    model: bytes,
    num_nodes_kept: int,
    counts: Mapping[str, Mapping[Tier, int]],
) -> None:
    """AssertionError on the first thing in the tree under ``roots`` that does not add up
    with the fingerprint ``model`` seeding its roots and the counters a `RadixCache` keeps
    (``num_nodes_kept``, ``counts["cached"]`` and ``counts["evictable"]`` blocks per tier)."""
    bs = block_size
    cached = dict.fromkeys(Tier, 0)
    evictable = dict.fromkeys(Tier, 0)
    seen: dict[Tier, set[int]] = {tier: set() for tier in Tier}
    num_nodes = 0
    for salt, root in roots.items():
        require(root.is_root and root.parent is None, f"root of salt {salt!r} is malformed")
        require(not root.blocks and not root.hashes, "a root must hold no blocks")
        require(root.last_hash() == root_hash(salt, model), f"root seed of salt {salt!r} is wrong")
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for key, child in node.children.items():
                stack.append(child)
                child_locks += child.lock_count
                require(child.alive, "a removed node is still linked")
                require(child.parent is node, "child.parent does not point at its parent")
                require(key == child.tokens[:bs].tobytes(), "child keyed by wrong tokens")
            require(node.lock_count >= child_locks, f"lock count too low at {node!r}")
            if node.is_root:
                continue
            num_nodes += 1
            _check_node(bs, pools, node, seen, cached, evictable)
    require(num_nodes == num_nodes_kept, "node count drifted")
    for tier in Tier:
        require(cached[tier] == counts["cached"][tier], f"cached {tier} block count drifted")
        require(evictable[tier] == counts["evictable"][tier], f"evictable {tier} drifted")


def _check_node(
    bs: int,
    pools: Mapping[Tier, BlockPool],
    node: RadixNode,
    seen: dict[Tier, set[int]],
    cached: dict[Tier, int],
    evictable: dict[Tier, int],
) -> None:
    parent = node.parent
    assert parent is not None
    nb = len(node.tokens) // bs
    require(nb > 0 and len(node.tokens) == nb * bs, f"edge not whole blocks at {node!r}")
    require(node.depth_tokens == parent.depth_tokens + len(node.tokens), "depth drifted")
    require(bool(node.blocks), f"node without any copy at {node!r}")
    require(node.lock_count >= 0, f"negative lock count at {node!r}")
    if node.lock_count:
        require(Tier.DEVICE in node.blocks, f"locked node lacks a device copy: {node!r}")
    expected = chain_bytes(parent.last_hash(), int32_bytes(node.tokens), bs)
    require(node.hashes == expected, f"chained hashes are wrong at {node!r}")
    for tier, ids in node.blocks.items():
        require(len(ids) == nb, f"{tier} copy has {len(ids)} blocks, edge has {nb}")
        pool = pools.get(tier)
        require(pool is not None, f"copy in unconfigured tier {tier}")
        assert pool is not None
        for b in ids:
            require(b not in seen[tier], f"{tier} block {b} indexed twice")
            seen[tier].add(b)
            require(pool.refcount(b) >= 1, f"{tier} block {b} indexed but free")
        cached[tier] += nb
        if node.lock_count == 0:
            evictable[tier] += nb
        if is_candidate(node, tier):
            require(EvictionQueues.queued(node, tier), f"candidate not queued: {node!r}")
