"""Moving radix nodes' blocks between tiers off the step loop, and loading prefixes back.

Out (here): device -> host (a copy, then the device copy is dropped) or device -> disk (bytes
written under each block's chained hash). In (`TierLoader`): host -> device swaps and
verified disk reads, so a trajectory's cached prefix is device-resident again before it is
admitted.

While a copy runs, every block involved is pinned and every node read is move-locked in the
KV manager's `TierResidency`, so no eviction can free or drop them underneath. Completions
attach copies by block id along the node's path (a match may have split it meanwhile), and
anything that no longer fits is released, never forced. Tokens stay the truth: a block that
cannot be moved or read back is recomputed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.engine.executor import TierTransport, Transfer
from kvpilot.engine.tier_loader import NOTHING_LOADED, Load, TierLoader
from kvpilot.engine.tier_stats import MoveKind, MoveStage, TierStats
from kvpilot.errors import require
from kvpilot.memory import KVManager, RadixNode, Tier, Trajectory
from kvpilot.memory.hashing import HASH_BYTES
from kvpilot.memory.residency import Residency
from kvpilot.policy.meters import RateMeter

if TYPE_CHECKING:
    from kvpilot.store import DiskBlockStore

log = logging.getLogger(__name__)

DEFAULT_LINK_BYTES_PER_S = 2e9
DEFAULT_DISK_BYTES_PER_S = 2e8


@dataclass(eq=False, slots=True)
class Move:
    """Device blocks leaving for host (a copy) or disk (read the bytes, then write them)."""

    kind: MoveKind
    transfer: Transfer
    nodes: list[RadixNode]
    device_ids: list[int]
    dest: dict[int, int] = field(default_factory=dict)  # host: device id -> host id
    keys: list[bytes] = field(default_factory=list)  # disk: a chained hash per device id
    stage: MoveStage = MoveStage.COPY

    def pinned_blocks(self) -> list[tuple[Tier, int]]:
        return [(Tier.DEVICE, d) for d in self.device_ids] + [
            (Tier.HOST, h) for h in self.dest.values()
        ]


class TierMover:
    def __init__(
        self,
        kv: KVManager,
        stats: TierStats,
        clock: Callable[[], float],
        transport: TierTransport | None,
        disk: DiskBlockStore | None,
    ) -> None:
        self.kv = kv
        self.radix = kv.radix
        self.residency = kv.residency
        self.stats = stats
        self.now = clock
        self.transport = transport
        self.disk = disk
        self.host_pool = kv.pools.get(Tier.HOST)
        self.block_bytes = transport.block_bytes if transport is not None else 0
        self.link = RateMeter()  # device <-> host, both directions
        self.moves: list[Move] = []
        self.loader: TierLoader | None = None
        if transport is not None:
            self.loader = TierLoader(kv, stats, clock, transport, disk, self.link, self.block_bytes)
        if transport is not None and self.host_pool is not None:
            self._probe_link()
        if transport is not None and disk is not None:
            self._probe_disk()

    # -- measured bandwidth ----------------------------------------------------------------

    def _probe_link(self) -> None:
        """A short copy out and back at start, so the first decision has a real figure."""
        assert self.transport is not None and self.host_pool is not None
        n = min(8, self.kv.device.num_free, self.host_pool.num_free)
        if n < 1:
            return
        dev = self.kv.device.allocate(n)
        host = self.host_pool.allocate(n)
        try:
            out = self.transport.swap_out(list(zip(dev, host, strict=True))).result()
            back = self.transport.swap_in(list(zip(host, dev, strict=True))).result()
            for seconds in (out, back):
                self.link.observe(n * self.block_bytes, float(seconds))
        finally:
            self.kv.device.free(dev)
            self.host_pool.free(host)

    def _probe_disk(self) -> None:
        """Write and read back two throwaway blocks: the disk store measures its bandwidth."""
        assert self.disk is not None
        blob = bytes(self.block_bytes or 4096)
        keys = [(b"kvpilot-probe-%02d" % i).ljust(HASH_BYTES, b"\0") for i in range(2)]
        self.disk.put_many([(k, blob) for k in keys]).result()
        self.disk.get_many(keys)
        for k in keys:
            self.disk.delete(k)

    def link_bw(self) -> float:
        if self.transport is None or self.host_pool is None:
            return 0.0
        return self.link.get(DEFAULT_LINK_BYTES_PER_S)

    def device_link_bw(self) -> float:
        """Device <-> host memory bandwidth, which every move off the device crosses (a move
        to disk too, through staging memory, whether or not there is a host tier)."""
        if self.transport is None:
            return 0.0
        return self.link.get(DEFAULT_LINK_BYTES_PER_S)

    def disk_bw(self) -> float:
        """The disk store's own measure of its reads (one meter: the store's)."""
        if self.transport is None or self.disk is None:
            return 0.0
        return self.disk.stats.read_bw_bytes_s or DEFAULT_DISK_BYTES_PER_S

    @property
    def has_host(self) -> bool:
        return self.transport is not None and self.host_pool is not None

    def busy(self) -> bool:
        return bool(self.moves or (self.loader is not None and self.loader.loads))

    # -- out ----------------------------------------------------------------------------------

    def swap_out(self, nodes: list[RadixNode]) -> Move | None:
        """Copy the nodes' device blocks to host; their device copies go when it is done."""
        assert self.transport is not None and self.host_pool is not None
        chosen: list[RadixNode] = []
        dest: dict[int, int] = {}
        for node in nodes:
            dev = node.blocks.get(Tier.DEVICE)
            if not node.alive or not dev or Tier.HOST in node.blocks or node.lock_count:
                continue
            host = self.residency.allocate_pinned(Tier.HOST, len(dev))
            if host is None:
                break  # no host room: the rest stays in the device cache (LRU decides)
            self.residency.pin(Tier.DEVICE, dev)
            dest.update(zip(dev, host, strict=True))
            chosen.append(node)
        if not chosen:
            return None
        self.residency.lock_for_move(chosen)  # no eviction may drop their device copy mid-copy
        transfer = self.transport.swap_out(list(dest.items()))
        move = Move(MoveKind.HOST, transfer, chosen, list(dest), dest)
        self.moves.append(move)
        return move

    def write_disk(self, nodes: list[RadixNode]) -> Move | None:
        """Write the nodes' device blocks to disk; their device copies go when it is done."""
        assert self.transport is not None and self.disk is not None
        chosen: list[RadixNode] = []
        ids: list[int] = []
        keys: list[bytes] = []
        for node in nodes:
            dev = node.blocks.get(Tier.DEVICE)
            if not node.alive or not dev or node.lock_count:
                continue
            h = node.hashes
            self.residency.pin(Tier.DEVICE, dev)
            ids += dev
            keys += [h[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(len(dev))]
            chosen.append(node)
        if chosen:
            self.residency.lock_for_move(chosen)
            read = self.transport.read_device(ids)
            move = Move(MoveKind.DISK, read, chosen, ids, keys=keys, stage=MoveStage.READ)
            self.moves.append(move)
            return move
        return None

    def _finish_move(self, move: Move) -> bool:
        """Advance a move whose transfer is done; True when it is complete."""
        residency = self.residency
        try:
            result = move.transfer.result()
        except Exception:  # a failed copy: everything stays where it was
            log.exception("a %s move failed; the blocks stay on the device", move.kind)
            residency.unlock_move(move.nodes)
            if move.kind is MoveKind.HOST:
                residency.unpin(Tier.HOST, list(move.dest.values()))
            residency.unpin(Tier.DEVICE, move.device_ids)
            return True
        nbytes = len(move.device_ids) * self.block_bytes
        if move.kind is MoveKind.HOST:
            residency.unlock_move(move.nodes)
            self.link.observe(nbytes, float(result))
            self.stats.bytes_moved["device_to_host"] += nbytes
            used: set[int] = set()
            for node in move.nodes:
                attached, got = residency.attach(node, Tier.DEVICE, Tier.HOST, move.dest)
                used |= got
                residency.drop_device_copies(attached)
            for host in move.dest.values():
                residency.unpin(Tier.HOST, [host], drop_reference=host not in used)
            residency.unpin(Tier.DEVICE, move.device_ids)
            return True
        assert self.disk is not None
        if move.stage is MoveStage.READ:
            move.transfer = self.disk.put_many(list(zip(move.keys, result, strict=True)))
            move.stage = MoveStage.WRITE
            return False
        residency.unlock_move(move.nodes)
        written = {d for d, ok in zip(move.device_ids, result, strict=True) if ok}
        self.stats.bytes_moved["device_to_disk"] += len(written) * self.block_bytes
        for bottom in move.nodes:
            residency.drop_moved_path(bottom, written)
        residency.unpin(Tier.DEVICE, move.device_ids)
        return True

    def wait_moves(self) -> None:
        """Block until every move out is done (memory pressure wants the blocks now)."""
        for move in list(self.moves):
            while True:
                move.transfer.result()
                if self._finish_move(move):
                    break
            self.moves.remove(move)

    # -- in (the loader) ----------------------------------------------------------------------

    def ensure_resident(
        self, traj: Trajectory, *, prefetch: bool = False, session_id: str | None = None
    ) -> Residency:
        if self.loader is None:
            return Residency.READY
        if not prefetch and session_id is None:  # every admission: no keyword call
            return self.loader.ensure_resident(traj)
        return self.loader.ensure_resident(traj, prefetch=prefetch, session_id=session_id)

    def load_of(self, traj: Trajectory) -> Load | None:
        """The load in flight for ``traj``, if any."""
        return None if self.loader is None else self.loader.loads.get(traj.traj_id)

    def take_loaded(self, traj: Trajectory) -> Mapping[Tier, int]:
        if self.loader is None:
            return NOTHING_LOADED
        return self.loader.take_loaded(traj)

    def hint_disk(self, traj: Trajectory) -> None:
        """``traj``'s blocks may be on disk: look there when it is next made resident."""
        if self.loader is not None:
            self.loader.disk_hint.add(traj.traj_id)

    def forget(self, traj: Trajectory) -> None:
        if self.loader is not None:
            self.loader.forget(traj)

    # -- the step loop ------------------------------------------------------------------------

    def in_flight(self) -> list[Transfer]:
        """The transfers the moves and loads are waiting on."""
        loads = self.loader.in_flight() if self.loader is not None else []
        return [move.transfer for move in self.moves] + loads

    def poll(self) -> list[Load]:
        """Advance every transfer that is done; returns the loads that completed."""
        still: list[Move] = []
        for move in self.moves:
            if not (move.transfer.done() and self._finish_move(move)):
                still.append(move)
        self.moves = still
        return self.loader.poll() if self.loader is not None else []

    def close(self) -> None:
        for move in self.moves:
            try:
                move.transfer.result()
            except Exception:
                log.debug("a move failed while shutting down", exc_info=True)
        if self.disk is not None:
            self.disk.close()
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()

    def check_invariants(self) -> None:
        """Every pinned block belongs to a move or a load in flight, as often as it is pinned;
        every move-locked node to a move."""
        held: dict[tuple[Tier, int], int] = {}
        jobs: list[Move | Load] = [*self.moves]
        if self.loader is not None:
            jobs += self.loader.loads.values()
        for job in jobs:
            for key in job.pinned_blocks():
                held[key] = held.get(key, 0) + 1
        pinned = {(tier, b): n for tier, b, n in self.residency.pinned()}
        require(
            pinned == held,
            f"pins {sorted(set(pinned.items()) ^ set(held.items()))[:5]} do not match the "
            "moves and loads in flight",
        )
        locks: dict[RadixNode, int] = {}
        for move in self.moves:
            for node in move.nodes:
                locks[node] = locks.get(node, 0) + 1
        require(dict(self.residency.move_locks) == locks, "move locks do not match the moves")
