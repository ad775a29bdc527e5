"""Tier residency of radix nodes while their blocks move: pins, move locks, attached copies.

A move copies a node's blocks to another tier off the step loop (device -> host, device ->
disk) and a load copies them back (host -> device). While a copy runs, every block it reads
or writes is *pinned* (one reference held here, so no eviction frees it underneath), and a
node whose device copy is being read is *move-locked* (a radix lock held by the move, not by
a trajectory: no eviction may drop the copy mid-read).

The tree may change meanwhile: a match splits a node at a block boundary, keeping the deeper
node's identity. So a finished copy is attached by block id along the node's path
(`attach`), covering any node split off above it, and anything that no longer fits is
released, never forced. `KVManager.check_invariants` counts pins and move locks with the
trajectories' references and locks; `check_invariants` here audits them on their own.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping

from kvpilot.errors import require
from kvpilot.memory.block_pool import BlockPool
from kvpilot.memory.radix import RadixCache
from kvpilot.memory.radix_node import RadixNode
from kvpilot.memory.tiers import Tier
from kvpilot.memory.trajectory import Trajectory


class Residency(enum.Enum):
    """Answer to "is this trajectory's cached prefix on the device?"."""

    READY = "ready"  # everything cached is device-resident (or nothing is cached elsewhere)
    LOADING = "loading"  # a load from host or disk is in flight: wait for it
    NO_ROOM = "no_room"  # it must be loaded, and the device has no free blocks to load into


# The members as module constants, for hot paths (as `kvpilot.memory.tiers` does).
READY, LOADING, NO_ROOM = Residency.READY, Residency.LOADING, Residency.NO_ROOM


class TierResidency:
    """Pins and move locks of copies in flight, and the attaching of finished copies."""

    def __init__(self, radix: RadixCache, pools: Mapping[Tier, BlockPool]) -> None:
        self.radix = radix
        self.pools = pools
        # References held by copies in flight, per tier and block.
        self.pins: dict[Tier, Counter[int]] = {tier: Counter() for tier in pools}
        # Radix locks held by moves (not by a trajectory), per node.
        self.move_locks: Counter[RadixNode] = Counter()

    # -- pins -----------------------------------------------------------------------------

    def pin(self, tier: Tier, blocks: Iterable[int], *, take_reference: bool = True) -> None:
        """Hold ``blocks`` for a copy in flight, so no eviction frees them under it.

        ``take_reference=False`` registers a reference the caller already owns (blocks it
        just allocated).
        """
        ids = list(blocks)
        if take_reference:
            self.pools[tier].incref_many(ids)
        self.pins[tier].update(ids)

    def unpin(self, tier: Tier, blocks: Iterable[int], *, drop_reference: bool = True) -> None:
        """Let go of pinned blocks; ``drop_reference=False`` hands the reference on."""
        ids = list(blocks)
        pins = self.pins[tier]
        for b in ids:
            left = pins.get(b, 0) - 1
            if left < 0:
                raise ValueError(f"{tier} block {b} is not pinned")
            if left:
                pins[b] = left
            else:
                del pins[b]
        if drop_reference:
            self.pools[tier].decref_many(ids)

    def allocate_pinned(self, tier: Tier, n: int) -> list[int] | None:
        """``n`` fresh blocks of ``tier`` (evicting that tier's cache if need be), pinned; None
        when there is no room."""
        pool = self.pools[tier]
        if pool.num_free < n:
            self.radix.evict(n - pool.num_free, tier)
        if pool.num_free < n:
            return None
        ids = pool.allocate(n)
        self.pin(tier, ids, take_reference=False)
        return ids

    # -- move locks -----------------------------------------------------------------------

    def lock_for_move(self, nodes: Iterable[RadixNode]) -> None:
        """No eviction may drop these nodes' device copies until `unlock_move`."""
        for node in nodes:
            self.radix.lock(node)
            self.move_locks[node] += 1

    def unlock_move(self, nodes: Iterable[RadixNode]) -> None:
        for node in nodes:
            if self.move_locks[node] < 1:
                raise ValueError(f"{node!r} is not locked by a move")
            self.radix.unlock(node)
            self.move_locks[node] -= 1
            if not self.move_locks[node]:
                del self.move_locks[node]

    # -- copies ---------------------------------------------------------------------------

    def attach(
        self, bottom: RadixNode, have: Tier, want: Tier, mapping: Mapping[int, int]
    ) -> tuple[list[RadixNode], set[int]]:
        """Give each node on ``bottom``'s path whose ``have`` blocks are all in ``mapping`` a
        ``want`` copy of the mapped blocks (walking up covers nodes split off above it).

        Returns the nodes that got a copy and the ``want`` blocks now indexed by the radix:
        the reference the caller pinned on each is the radix's now (unpin those with
        ``drop_reference=False``), the others are still the caller's to drop.
        """
        nodes: list[RadixNode] = []
        used: set[int] = set()
        node: RadixNode | None = bottom
        while node is not None and node.alive and not node.is_root:
            ids = node.blocks.get(have)
            if not ids or any(b not in mapping for b in ids):
                break
            if want not in node.blocks:
                copy = [mapping[b] for b in ids]
                self.radix.add_copy(node, want, copy)
                used.update(copy)
                nodes.append(node)
            node = node.parent
        return nodes, used

    def drop_device_copies(self, nodes: Iterable[RadixNode]) -> None:
        """Drop the device copy of each of ``nodes`` no trajectory locks (it lives elsewhere)."""
        for node in nodes:
            if node.alive and Tier.DEVICE in node.blocks and node.lock_count == 0:
                self.radix.drop_copy(node, Tier.DEVICE)

    def drop_moved_path(self, bottom: RadixNode, moved: set[int]) -> None:
        """After device blocks ``moved`` were copied out (to disk): walking up from ``bottom``
        while a node's device blocks all moved, drop its device copy if no one locks it. The
        walk ends at a node that held no other copy (dropping removed it from the tree), and
        below a node a child of which keeps its device copy (a failed write deeper down): the
        device copies of a path stay a prefix of it."""
        node: RadixNode | None = bottom
        while node is not None and node.alive and not node.is_root:
            dev = node.blocks.get(Tier.DEVICE)
            if not dev or any(b not in moved for b in dev):
                break
            if any(Tier.DEVICE in child.blocks for child in node.children.values()):
                break
            if node.lock_count == 0:
                self.radix.drop_copy(node, Tier.DEVICE)
            node = node.parent if node.alive else None

    def exclusive_nodes(self, traj: Trajectory) -> list[RadixNode]:
        """The deepest part of the trajectory's path that no one else locks, deepest first."""
        nodes: list[RadixNode] = []
        node: RadixNode | None = traj.locked_node
        while node is not None and node.depth_tokens and node.lock_count == 1:  # not a root
            nodes.append(node)
            node = node.parent
        return nodes

    # -- integrity ------------------------------------------------------------------------

    def pinned(self) -> Iterator[tuple[Tier, int, int]]:
        """(tier, block, pins) for every pinned block."""
        for tier, pins in self.pins.items():
            for block, n in pins.items():
                yield tier, block, n

    def check_invariants(self) -> None:
        for tier, block, n in self.pinned():
            require(n > 0, f"{tier} block {block} pinned {n} times")
            pool = self.pools[tier]
            require(
                pool.refcount(block) >= n,
                f"{tier} block {block} is pinned {n} times but has {pool.refcount(block)} refs",
            )
        for node, n in self.move_locks.items():
            require(n > 0, f"{node!r} move-locked {n} times")
            require(node.alive, f"a move locks an evicted node: {node!r}")
            require(node.lock_count >= n, f"{node!r}: {n} move locks > its lock count")
            require(Tier.DEVICE in node.blocks, f"a move locks a node off the device: {node!r}")
