"""The KV manager: one pool per tier, the radix prefix cache, the open trajectories, and the
residency of copies in flight between tiers."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from kvpilot.errors import ConfigError, OutOfBlocks, require
from kvpilot.memory.block_pool import BlockPool
from kvpilot.memory.radix import RadixCache, RadixNode
from kvpilot.memory.residency import TierResidency
from kvpilot.memory.tiers import Tier
from kvpilot.memory.trajectory import ForkResult, Trajectory
from kvpilot.memory.window import NULL_BLOCK, WindowPool


@dataclass(frozen=True, slots=True, kw_only=True)
class KVConfig:
    block_size: int = 16
    num_device_blocks: int
    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    model_fingerprint: bytes = b""  # seeds the chained block hashes (memory.hashing)
    # Hybrid models: the sliding-window layer group (memory.window). 0: no such group.
    window_tokens: int = 0
    num_window_blocks: int = 0  # the window group's pool, its null block included
    window_block_bytes: int = 0  # one window-group block's KV on the device (0: unknown)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1 token, got {self.block_size}")
        if self.num_device_blocks < 1:
            raise ConfigError(f"num_device_blocks must be >= 1, got {self.num_device_blocks}")
        if self.num_host_blocks < 0 or self.num_disk_blocks < 0:
            raise ConfigError(
                f"num_host_blocks and num_disk_blocks must be >= 0, got "
                f"{self.num_host_blocks} and {self.num_disk_blocks}"
            )
        if self.window_tokens < 0 or (self.window_tokens and self.num_window_blocks < 2):
            raise ConfigError(
                f"a window group needs window_tokens >= 1 and num_window_blocks >= 2, got "
                f"{self.window_tokens} and {self.num_window_blocks}"
            )


class KVManager:
    """Owns the pools (one per tier), the radix cache and the open trajectories."""

    def __init__(self, config: KVConfig, clock: Callable[[], float] | None = None) -> None:
        self.config = config
        self.block_size = config.block_size
        sizes = {
            Tier.DEVICE: config.num_device_blocks,
            Tier.HOST: config.num_host_blocks,
            Tier.DISK: config.num_disk_blocks,
        }
        self.pools: dict[Tier, BlockPool] = {
            tier: BlockPool(n, tier) for tier, n in sizes.items() if n > 0
        }
        self.device = self.pools[Tier.DEVICE]
        self.model_digest = config.model_fingerprint
        self.window: WindowPool | None = None
        if config.window_tokens:
            self.window = WindowPool(
                config.num_window_blocks,
                config.window_tokens,
                config.block_size,
                config.window_block_bytes,
            )
        self.radix = RadixCache(config.block_size, self.pools, clock, config.model_fingerprint)
        # What `free_blocks` reads (asked on every step): the device pool's free list and the
        # radix's device tally, objects neither replaces.
        self._device_free = self.device._free
        self._device_tally = self.radix._device_tally
        self.trajectories: dict[int, Trajectory] = {}
        # The registered trajectories that hold device blocks (a non-empty table), kept by
        # the trajectories where their tables fill or empty: a load gauge read per sample.
        self.resident_trajectories = 0
        # Pins and move locks of copies in flight between tiers (counted by check_invariants).
        self.residency = TierResidency(self.radix, self.pools)
        # Radix locks held by prompt-cache breakpoints for their TTL: counted likewise.
        self.prefix_pins: Counter[RadixNode] = Counter()
        self._ids = itertools.count()

    def open_trajectory(self, salt: str | None = None, tokens: Iterable[int] = ()) -> Trajectory:
        traj = Trajectory(self, self.next_trajectory_id(), salt, tokens)
        self.register(traj)
        return traj

    def fork_or_defer(self, traj: Trajectory, *, defer: bool = False) -> ForkResult:
        """Fork ``traj`` (figure 5), or defer the child when asked to or out of blocks.

        A deferred child shares nothing yet: it is a new trajectory on the parent's tokens
        (whose full blocks the parent has just committed to the cache), with no KV computed.
        Admitted later, it reuses the cached prefix and recomputes only the partial tail.
        """
        if not defer:
            try:
                return traj.fork()
            except OutOfBlocks:
                pass  # no block for the partial tail
        traj.commit()
        return ForkResult(self.open_trajectory(traj.salt, traj.tokens), None, deferred=True)

    def next_trajectory_id(self) -> int:
        return next(self._ids)

    def register(self, traj: Trajectory) -> None:
        assert traj.traj_id not in self.trajectories, f"trajectory {traj.traj_id} registered twice"
        self.trajectories[traj.traj_id] = traj
        if traj.block_table:  # a fork's child, born with the parent's blocks
            self.resident_trajectories += 1

    def deregister(self, traj: Trajectory) -> None:
        if self.trajectories.pop(traj.traj_id, None) is not None and traj.block_table:
            self.resident_trajectories -= 1

    def free_blocks(self) -> int:
        """Device blocks admission can count on: free now plus evictable from the cache."""
        return len(self._device_free) + self._device_tally.evictable

    def ensure_free(self, n: int) -> bool:
        short = n - self.device.num_free
        if short <= 0:
            return True
        if n > self.free_blocks():
            return False
        self.radix.evict(short)
        return self.device.num_free >= n

    @property
    def usage(self) -> float:
        """Device U_KV; cached-but-evictable blocks count as used."""
        return self.device.usage

    def check_invariants(self) -> None:
        for pool in self.pools.values():
            pool.check_invariants()
        self.radix.check_invariants()
        expected = {
            tier: np.zeros(pool.num_blocks, dtype=np.int64) for tier, pool in self.pools.items()
        }
        indexed_device: set[int] = set()
        for indexed in self.radix.iter_nodes():
            for tier, ids in indexed.blocks.items():
                expected[tier][ids] += 1
            indexed_device.update(indexed.blocks.get(Tier.DEVICE, ()))
        locks: Counter[RadixNode] = Counter()
        window_refs = [0] * (self.window.pool.num_blocks if self.window is not None else 0)
        for traj_id, traj in self.trajectories.items():
            require(traj.traj_id == traj_id, f"trajectory {traj.traj_id} registered as {traj_id}")
            require(not traj.closed, f"closed trajectory {traj_id} is still registered")
            traj.check_invariants()
            shared = traj.locked_tokens // self.block_size
            expected[Tier.DEVICE][traj.block_table[shared:]] += 1  # its lock holds the rest
            if traj.window is not None:
                for b in traj.window.blocks:
                    if b != NULL_BLOCK:
                        window_refs[b] += 1
            private = set(traj.block_table[shared:])
            require(
                not private & indexed_device,
                f"trajectory {traj_id} holds a private block that the radix indexes",
            )
            node: RadixNode | None = traj.locked_node
            while node is not None:
                locks[node] += 1
                node = node.parent
        resident = sum(1 for traj in self.trajectories.values() if traj.block_table)
        require(
            self.resident_trajectories == resident,
            f"resident_trajectories is {self.resident_trajectories}, but {resident} "
            "registered trajectories hold blocks",
        )
        if self.window is not None:
            self.window.check_invariants(window_refs)
        self.residency.check_invariants()
        for bottom, n in (self.residency.move_locks + self.prefix_pins).items():
            up: RadixNode | None = bottom
            while up is not None:
                locks[up] += n
                up = up.parent
        for tier, b, n in self.residency.pinned():
            expected[tier][b] += n
        for tier, pool in self.pools.items():
            wrong = np.flatnonzero(pool.refcounts() != expected[tier])
            if wrong.size:
                b = int(wrong[0])
                raise AssertionError(
                    f"{tier} block {b}: refcount {pool.refcount(b)}, but radix, trajectories "
                    f"and pins hold {int(expected[tier][b])} references"
                )
        for node in self.radix.iter_nodes():
            require(
                node.lock_count == locks[node],
                f"{node!r}: lock count {node.lock_count}, trajectories and moves lock it "
                f"{locks[node]} times",
            )
