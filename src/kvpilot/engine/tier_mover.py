"""Moving radix nodes' blocks between tiers off the step loop, and loading prefixes back.

Out: device -> host (a copy, then the device copy is dropped) or device -> disk (bytes
written under each block's chained hash). In: host -> device swaps and verified disk reads,
so a trajectory's cached prefix is device-resident again before it is admitted.

While a copy runs, every block involved is pinned (`KVManager.pin`), so no eviction can
free it underneath. The tree may change meanwhile (a match splits a node at a block
boundary): completions therefore match blocks by id along the node's path rather than
trusting a node's shape, and anything that no longer fits is released, never forced.
Tokens stay the truth: a block that cannot be moved or read back is recomputed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.engine.executor import TierTransport, Transfer
from kvpilot.engine.tier_stats import TierStats
from kvpilot.errors import OutOfBlocks
from kvpilot.memory import KVManager, RadixNode, Tier, Trajectory
from kvpilot.memory.hashing import block_hash
from kvpilot.memory.residency import Residency
from kvpilot.policy.meters import RateMeter

if TYPE_CHECKING:
    from kvpilot.store import DiskBlockStore

log = logging.getLogger(__name__)

HASH_BYTES = 16
DEFAULT_LINK_BYTES_PER_S = 2e9
DEFAULT_DISK_BYTES_PER_S = 2e8


@dataclass(eq=False, slots=True)
class _Move:
    """Device blocks leaving for host ("host") or disk ("disk": read, then write)."""

    kind: str
    transfer: Transfer
    nodes: list[RadixNode]
    device_ids: list[int]
    dest: dict[int, int] = field(default_factory=dict)  # host: device id -> host id
    keys: list[bytes] = field(default_factory=list)  # disk: a chained hash per device id
    stage: str = "copy"


@dataclass(eq=False, slots=True)
class _Load:
    """A trajectory's prefix coming back to the device."""

    traj: Trajectory
    started: float
    prefetch: bool
    session_id: str | None
    host_nodes: list[RadixNode]
    host_map: dict[int, int]  # host id -> device id
    host_transfer: Transfer | None
    disk_anchor: RadixNode
    disk_tokens: list[int]
    disk_keys: list[bytes]
    disk_ids: list[int]
    host_tokens: int = 0
    disk_transfer: Transfer | None = None
    disk_stage: str = "read"
    done_host: bool = False
    done_disk: bool = False


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
        self.stats = stats
        self.now = clock
        self.transport = transport
        self.disk = disk
        self.host_pool = kv.pools.get(Tier.HOST)
        self.block_bytes = transport.block_bytes if transport is not None else 0
        self.link = RateMeter()
        self.disk_link = RateMeter()
        self.moves: list[_Move] = []
        self.loads: dict[int, _Load] = {}
        self.loaded: dict[int, dict[str, int]] = {}  # traj_id -> tokens loaded per tier
        self.disk_hint: set[int] = set()  # trajectories whose blocks may be on disk
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
        """Write and read back two throwaway blocks to seed the disk bandwidth meter."""
        assert self.disk is not None
        blob = bytes(self.block_bytes or 4096)
        keys = [(b"kvpilot-probe-%02d" % i).ljust(HASH_BYTES, b"\0") for i in range(2)]
        self.disk.put_many([(k, blob) for k in keys]).result()
        self.disk.get_many(keys)
        if self.disk.stats.read_bw_bytes_s:
            self.disk_link.observe(self.disk.stats.read_bw_bytes_s, 1.0)
        for k in keys:
            self.disk.delete(k)

    def link_bw(self) -> float:
        if self.transport is None or self.host_pool is None:
            return 0.0
        return self.link.get(DEFAULT_LINK_BYTES_PER_S)

    def disk_bw(self) -> float:
        if self.transport is None or self.disk is None:
            return 0.0
        return self.disk_link.get(self.disk.stats.read_bw_bytes_s or DEFAULT_DISK_BYTES_PER_S)

    def busy(self) -> bool:
        return bool(self.moves or self.loads)

    # -- attaching copies by block id ---------------------------------------------------------

    def _attach(
        self, bottom: RadixNode, have: Tier, want: Tier, mapping: dict[int, int]
    ) -> tuple[list[RadixNode], set[int]]:
        """Give each node on ``bottom``'s path whose ``have`` blocks are all in ``mapping`` a
        ``want`` copy of the mapped blocks (walking up covers nodes split off above it)."""
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

    # -- out ----------------------------------------------------------------------------------

    def _alloc_host(self, n: int) -> list[int] | None:
        assert self.host_pool is not None
        if self.host_pool.num_free < n:
            self.radix.evict(n - self.host_pool.num_free, Tier.HOST)
        if self.host_pool.num_free < n:
            return None
        ids = self.host_pool.allocate(n)
        self.kv.pin(Tier.HOST, ids, take_reference=False)
        return ids

    def swap_out(self, nodes: list[RadixNode]) -> _Move | None:
        """Copy the nodes' device blocks to host; their device copies go when it is done."""
        assert self.transport is not None and self.host_pool is not None
        chosen: list[RadixNode] = []
        dest: dict[int, int] = {}
        for node in nodes:
            dev = node.blocks.get(Tier.DEVICE)
            if not node.alive or not dev or Tier.HOST in node.blocks or node.lock_count:
                continue
            host = self._alloc_host(len(dev))
            if host is None:
                break  # no host room: the rest stays in the device cache (LRU decides)
            self.kv.pin(Tier.DEVICE, dev)
            dest.update(zip(dev, host, strict=True))
            chosen.append(node)
        if not chosen:
            return None
        self._lock(chosen)  # no eviction may drop their device copy mid-copy
        ids = list(dest)
        move = _Move("host", self.transport.swap_out(list(dest.items())), chosen, ids, dest)
        self.moves.append(move)
        return move

    def write_disk(self, nodes: list[RadixNode]) -> None:
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
            self.kv.pin(Tier.DEVICE, dev)
            ids += dev
            keys += [h[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(len(dev))]
            chosen.append(node)
        if chosen:
            self._lock(chosen)
            read = self.transport.read_device(ids)
            self.moves.append(_Move("disk", read, chosen, ids, keys=keys, stage="read"))

    def _finish_move(self, move: _Move) -> bool:
        """Advance a move whose transfer is done; True when it is complete."""
        try:
            result = move.transfer.result()
        except Exception:  # a failed copy: everything stays where it was
            log.exception("a %s move failed; the blocks stay on the device", move.kind)
            self._unlock(move)
            if move.kind == "host":
                self.kv.unpin(Tier.HOST, list(move.dest.values()))
            self.kv.unpin(Tier.DEVICE, move.device_ids)
            return True
        if move.kind == "host":
            self._unlock(move)
            self.link.observe(len(move.device_ids) * self.block_bytes, float(result))
            self.stats.bytes_moved["device_to_host"] += len(move.device_ids) * self.block_bytes
            used: set[int] = set()
            for node in move.nodes:
                attached, got = self._attach(node, Tier.DEVICE, Tier.HOST, move.dest)
                used |= got
                for n in attached:
                    if n.lock_count == 0:
                        self.radix.drop_copy(n, Tier.DEVICE)
            for host in move.dest.values():
                self.kv.unpin(Tier.HOST, [host], drop_reference=host not in used)
            self.kv.unpin(Tier.DEVICE, move.device_ids)
            return True
        assert self.disk is not None
        if move.stage == "read":
            move.transfer = self.disk.put_many(list(zip(move.keys, result, strict=True)))
            move.stage = "write"
            return False
        self._unlock(move)
        written = {d for d, ok in zip(move.device_ids, result, strict=True) if ok}
        self.stats.bytes_moved["device_to_disk"] += len(written) * self.block_bytes
        for bottom in move.nodes:
            node: RadixNode | None = bottom
            while node is not None and node.alive and not node.is_root:
                dev = node.blocks.get(Tier.DEVICE)
                if not dev or any(b not in written for b in dev):
                    break
                if node.lock_count == 0:
                    self.radix.drop_copy(node, Tier.DEVICE)
                node = node.parent if node.alive else None
        self.kv.unpin(Tier.DEVICE, move.device_ids)
        return True

    def _lock(self, nodes: list[RadixNode]) -> None:
        for node in nodes:
            self.radix.lock(node)
            self.kv.move_locks[node] += 1

    def _unlock(self, move: _Move) -> None:
        for node in move.nodes:
            self.radix.unlock(node)
            self.kv.move_locks[node] -= 1
            if not self.kv.move_locks[node]:
                del self.kv.move_locks[node]

    # -- in -----------------------------------------------------------------------------------

    def ensure_resident(
        self, traj: Trajectory, *, prefetch: bool = False, session_id: str | None = None
    ) -> Residency:
        """READY when the trajectory's cached prefix is on the device; else start loading it
        (LOADING), or say there is no device room to load it into (NO_ROOM)."""
        job = self.loads.get(traj.traj_id)
        if job is not None:
            if not prefetch and job.prefetch:
                job.prefetch = False
                self.stats.prefetch_stalls += 1
            return Residency.LOADING
        if self.transport is None:
            return Residency.READY
        if not self.radix.cached_blocks(Tier.HOST) and traj.traj_id not in self.disk_hint:
            return Residency.READY  # nothing lives off the device: every admission's fast path
        buf = traj.token_array()
        tokens = buf[: max(len(buf) - 1, 0)]
        match = self.radix.match(tokens, traj.salt, record=False, tier=None)
        host_nodes = [n for n in match.path if Tier.DEVICE not in n.blocks]
        disk_keys, disk_tokens = self._disk_probe(traj, match.node, match.num_tokens, tokens)
        if not host_nodes and not disk_keys:
            self.disk_hint.discard(traj.traj_id)
            return Residency.READY
        need = sum(n.num_blocks for n in host_nodes) + len(disk_keys)
        dev = self._allocate_device(need, match.path, host_nodes)
        if dev is None:
            return Residency.NO_ROOM
        host_map: dict[int, int] = {}
        for node in host_nodes:
            host = node.blocks[Tier.HOST]
            self.kv.pin(Tier.HOST, host)
            host_map.update(zip(host, dev[len(host_map) : len(host_map) + len(host)], strict=True))
        job = _Load(
            traj=traj,
            started=self.now(),
            prefetch=prefetch,
            session_id=session_id,
            host_nodes=host_nodes,
            host_map=host_map,
            host_transfer=self.transport.swap_in(list(host_map.items())) if host_map else None,
            disk_anchor=match.node,
            disk_tokens=disk_tokens,
            disk_keys=disk_keys,
            disk_ids=dev[len(host_map) :],
            host_tokens=sum(len(n.tokens) for n in host_nodes),
        )
        job.done_host = not host_map
        job.done_disk = not disk_keys
        self.loads[traj.traj_id] = job
        if not prefetch:
            self.stats.prefetch_stalls += 1
        return Residency.LOADING

    def _allocate_device(
        self, need: int, path: list[RadixNode], host_nodes: list[RadixNode]
    ) -> list[int] | None:
        # Keep the device-resident start of the path from being evicted to make room.
        resident = path[: path.index(host_nodes[0])] if host_nodes else path
        guard = resident[-1] if resident else None
        if guard is not None:
            self.radix.lock(guard)
        try:
            if not self.kv.ensure_free(need):
                return None
            dev = self.kv.device.allocate(need)
        except OutOfBlocks:
            return None
        finally:
            if guard is not None:
                self.radix.unlock(guard)
        self.kv.pin(Tier.DEVICE, dev, take_reference=False)
        return dev

    def _disk_probe(
        self, traj: Trajectory, anchor: RadixNode, matched: int, tokens: object
    ) -> tuple[list[bytes], list[int]]:
        if self.disk is None or traj.traj_id not in self.disk_hint:
            return [], []
        bs = self.kv.block_size
        toks = list(tokens)  # type: ignore[call-overload]
        h = anchor.last_hash()
        keys: list[bytes] = []
        for b in range(matched // bs, len(toks) // bs):
            h = block_hash(h, toks[b * bs : (b + 1) * bs])
            if not self.disk.contains(h):
                break
            keys.append(h)
        return keys, toks[matched : matched + len(keys) * bs]

    def _advance_load(self, job: _Load) -> bool:
        """Progress a load whose current transfer finished; True when it is complete."""
        if not job.done_host and job.host_transfer is not None and job.host_transfer.done():
            self._finish_host_load(job)
        if job.done_host and not job.done_disk:
            assert self.disk is not None
            if job.disk_transfer is None:
                job.disk_transfer = self.disk.get_async(job.disk_keys)
            elif job.disk_transfer.done():
                self._advance_disk_load(job)
        return job.done_host and job.done_disk

    def _finish_host_load(self, job: _Load) -> None:
        assert job.host_transfer is not None
        nbytes = len(job.host_map) * self.block_bytes
        used: set[int] = set()
        try:
            self.link.observe(nbytes, float(job.host_transfer.result()))
            for node in job.host_nodes:
                used |= self._attach(node, Tier.HOST, Tier.DEVICE, job.host_map)[1]
            self.stats.bytes_moved["host_to_device"] += nbytes
            self._count_loaded(job.traj, "host", len(used) * self.kv.block_size)
        except Exception:
            log.exception("a host-to-device load failed; those blocks will be recomputed")
        for host, dev in job.host_map.items():
            self.kv.unpin(Tier.DEVICE, [dev], drop_reference=dev not in used)
            self.kv.unpin(Tier.HOST, [host])
        job.done_host = True

    def _advance_disk_load(self, job: _Load) -> None:
        assert job.disk_transfer is not None and self.transport is not None
        if job.disk_stage == "read":
            data: list[bytes | None] = job.disk_transfer.result()
            good = next((i for i, d in enumerate(data) if d is None), len(data))
            self.stats.disk_misses += len(data) - good
            if job.disk_ids[good:]:
                self.kv.unpin(Tier.DEVICE, job.disk_ids[good:])
            job.disk_ids = job.disk_ids[:good]
            job.disk_tokens = job.disk_tokens[: good * self.kv.block_size]
            if not good:
                job.done_disk = True
                return
            job.disk_transfer = self.transport.write_device(job.disk_ids, data[:good])  # type: ignore[arg-type]
            job.disk_stage = "write"
            return
        try:
            seconds = float(job.disk_transfer.result())
            anchor = job.disk_anchor
            if anchor.alive:
                self.radix.insert_below(anchor, job.disk_tokens, job.disk_ids)
                self._count_loaded(job.traj, "disk", len(job.disk_tokens))
            nbytes = len(job.disk_ids) * self.block_bytes
            self.disk_link.observe(nbytes, seconds)
            self.stats.bytes_moved["disk_to_device"] += nbytes
        except Exception:
            log.exception("writing disk blocks to the device failed; they will be recomputed")
        self.kv.unpin(Tier.DEVICE, job.disk_ids)
        job.done_disk = True

    def _count_loaded(self, traj: Trajectory, tier: str, tokens: int) -> None:
        self.stats.loaded_tokens[tier] += tokens
        per = self.loaded.setdefault(traj.traj_id, {"host": 0, "disk": 0})
        per[tier] += tokens

    def take_loaded(self, traj: Trajectory) -> dict[str, int]:
        return self.loaded.pop(traj.traj_id, {"host": 0, "disk": 0})

    # -- the step loop ------------------------------------------------------------------------

    def poll(self) -> list[_Load]:
        """Advance every transfer that is done; returns the loads that completed."""
        still: list[_Move] = []
        for move in self.moves:
            if not (move.transfer.done() and self._finish_move(move)):
                still.append(move)
        self.moves = still
        finished = []
        for traj_id, job in list(self.loads.items()):
            if self._advance_load(job):
                del self.loads[traj_id]
                self.stats.reload_s.append(self.now() - job.started)
                finished.append(job)
        return finished

    def wait_moves(self) -> None:
        """Block until every move out is done (memory pressure wants the blocks now)."""
        for move in list(self.moves):
            while True:
                move.transfer.result()
                if self._finish_move(move):
                    break
            self.moves.remove(move)

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
