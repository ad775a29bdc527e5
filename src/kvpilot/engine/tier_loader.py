"""Loading a trajectory's cached prefix back to the device from host and disk, off the step loop.

Host copies swap back in; disk blocks (found under the chained hash of the tokens past the
last cached node) are read, verified and written to the device, then inserted below that
node. A corrupt, truncated or missing block ends the load there: the rest is recomputed.
Until its load is done a trajectory waits (admission asks `ensure_resident`); the blocks
being loaded into are pinned in the `TierResidency`, never evictable.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from kvpilot.engine.executor import TierTransport, Transfer
from kvpilot.engine.tier_stats import MoveStage, TierStats
from kvpilot.errors import OutOfBlocks
from kvpilot.memory import KVManager, RadixNode, Tier, Trajectory
from kvpilot.memory.hashing import block_hash
from kvpilot.memory.residency import LOADING, NO_ROOM, READY, Residency
from kvpilot.memory.tiers import HOST
from kvpilot.policy.meters import RateMeter

if TYPE_CHECKING:
    from kvpilot.store import DiskBlockStore

log = logging.getLogger(__name__)

OFF_DEVICE = (Tier.HOST, Tier.DISK)
# `take_loaded`'s answer for a trajectory nothing was loaded for (almost every admission):
# one shared read-only mapping, not a new dict per call.
NOTHING_LOADED: Mapping[Tier, int] = MappingProxyType(dict.fromkeys(OFF_DEVICE, 0))
# A turn that needs its prefix back from host now (no prefetch brought it) waits for a load of
# at most this much link time in the step that wants it, as a compute stream waits on a copy
# event, instead of sitting out a whole step (the load noticed only at the next poll): on
# the emulated CPU run such resumes waited a step each, the most of their time to first token.
SYNC_LOAD_MAX_S = 0.01


@dataclass(eq=False, slots=True)
class Load:
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
    disk_transfer: Transfer | None = None
    disk_stage: MoveStage = MoveStage.READ
    done_host: bool = False
    done_disk: bool = False

    def pinned_blocks(self) -> list[tuple[Tier, int]]:
        """The blocks this load holds pinned right now."""
        out: list[tuple[Tier, int]] = []
        if not self.done_host:
            out += [(Tier.HOST, h) for h in self.host_map]
            out += [(Tier.DEVICE, d) for d in self.host_map.values()]
        if not self.done_disk:
            out += [(Tier.DEVICE, d) for d in self.disk_ids]
        return out


class TierLoader:
    def __init__(
        self,
        kv: KVManager,
        stats: TierStats,
        clock: Callable[[], float],
        transport: TierTransport,
        disk: DiskBlockStore | None,
        link: RateMeter,
        block_bytes: int,
    ) -> None:
        self.kv = kv
        self.radix = kv.radix
        self.residency = kv.residency
        self.stats = stats
        self.now = clock
        self.transport = transport
        self.disk = disk
        self.link = link
        self.block_bytes = block_bytes
        self.loads: dict[int, Load] = {}
        self.loaded: dict[int, dict[Tier, int]] = {}  # traj_id -> tokens loaded per tier
        self.disk_hint: set[int] = set()  # trajectories whose blocks may be on disk
        self.sync_loads = 0  # loads finished in the step that wanted them (`_finish_now`)

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
            if not prefetch and self._finish_now(job):
                return self.ensure_resident(traj, session_id=session_id)
            return LOADING
        on_disk = self.disk is not None and len(self.disk) > 0
        if not self.radix.cached_blocks(HOST) and not on_disk:
            return READY  # nothing lives off the device: every admission's fast path
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
            return NO_ROOM
        if any(not n.alive or Tier.HOST not in n.blocks for n in host_nodes):
            # Making room evicted a device-only node above one of them, and its subtree went
            # with it: give the blocks back and match again on the next step.
            self.residency.unpin(Tier.DEVICE, dev, drop_reference=True)
            return Residency.LOADING
        host_map: dict[int, int] = {}
        for node in host_nodes:
            host = node.blocks[Tier.HOST]
            self.residency.pin(Tier.HOST, host)
            host_map.update(zip(host, dev[len(host_map) : len(host_map) + len(host)], strict=True))
        job = Load(
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
        )
        job.done_host = not host_map
        job.done_disk = not disk_keys
        self.loads[traj.traj_id] = job
        if not prefetch:
            self.stats.prefetch_stalls += 1
            if self._finish_now(job):
                return self.ensure_resident(traj, session_id=session_id)
        return Residency.LOADING

    def _finish_now(self, job: Load) -> bool:
        """Wait for a host-only load whose copy has at most `SYNC_LOAD_MAX_S` of link time
        left and complete it; True when it did. Not on a transport whose ``sync_loads`` is
        False (the simulator's: `kvpilot.sim.transport.SimulatedTransport`)."""
        if job.host_transfer is None or job.done_host or not job.done_disk:
            return False
        if not getattr(self.transport, "sync_loads", True):
            return False  # a transport that says a step must not wait on its copies
        nbytes = len(job.host_map) * self.block_bytes
        finish = getattr(job.host_transfer, "finish_s", None)
        if isinstance(finish, float):  # a copy on a clock that says when it ends
            left = finish - self.now()
        else:
            bw = self.link.get(0.0)
            left = nbytes / bw if bw > 0 else math.inf
        if left > SYNC_LOAD_MAX_S:
            return False
        self._finish_host(job)
        self._retire(job)
        self.sync_loads += 1
        return True

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
        self.residency.pin(Tier.DEVICE, dev, take_reference=False)
        return dev

    def _disk_probe(
        self, traj: Trajectory, anchor: RadixNode, matched: int, tokens: object
    ) -> tuple[list[bytes], list[int]]:
        # Any request's prefix is looked up on disk by chained hash, not only paused or
        # restored sessions': a client resending a history, after a restart too, finds it.
        if self.disk is None:
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

    # -- progress -------------------------------------------------------------------------

    def in_flight(self) -> list[Transfer]:
        """The transfers the loads are waiting on."""
        out: list[Transfer] = []
        for job in self.loads.values():
            if not job.done_host and job.host_transfer is not None:
                out.append(job.host_transfer)
            elif not job.done_disk and job.disk_transfer is not None:
                out.append(job.disk_transfer)
        return out

    def poll(self) -> list[Load]:
        """Advance every load whose transfer is done; returns the loads that completed."""
        finished = []
        for job in list(self.loads.values()):
            if self._advance(job):
                self._retire(job)
                finished.append(job)
        return finished

    def _retire(self, job: Load) -> None:
        """A complete load leaves the table; its time from start to end is a reload time."""
        del self.loads[job.traj.traj_id]
        self.stats.reload_s.append(self.now() - job.started)

    def _advance(self, job: Load) -> bool:
        """Progress a load whose current transfer finished; True when it is complete."""
        if not job.done_host and job.host_transfer is not None and job.host_transfer.done():
            self._finish_host(job)
        if job.done_host and not job.done_disk:
            assert self.disk is not None
            if job.disk_transfer is None:
                job.disk_transfer = self.disk.get_async(job.disk_keys)
            elif job.disk_transfer.done():
                self._advance_disk(job)
        return job.done_host and job.done_disk

    def _finish_host(self, job: Load) -> None:
        assert job.host_transfer is not None
        nbytes = len(job.host_map) * self.block_bytes
        used: set[int] = set()
        try:
            self.link.observe(nbytes, float(job.host_transfer.result()))
            for node in job.host_nodes:
                used |= self.residency.attach(node, Tier.HOST, Tier.DEVICE, job.host_map)[1]
            self.stats.bytes_moved["host_to_device"] += nbytes
            self._count_loaded(job.traj, Tier.HOST, len(used) * self.kv.block_size)
        except Exception:
            log.exception("a host-to-device load failed; those blocks will be recomputed")
        for host, dev in job.host_map.items():
            self.residency.unpin(Tier.DEVICE, [dev], drop_reference=dev not in used)
            self.residency.unpin(Tier.HOST, [host])
        job.done_host = True

    def _advance_disk(self, job: Load) -> None:
        assert job.disk_transfer is not None
        if job.disk_stage is MoveStage.READ:
            data: list[bytes | None] = job.disk_transfer.result()
            good = next((i for i, d in enumerate(data) if d is None), len(data))
            self.stats.disk_misses += len(data) - good
            if job.disk_ids[good:]:
                self.residency.unpin(Tier.DEVICE, job.disk_ids[good:])
            job.disk_ids = job.disk_ids[:good]
            job.disk_tokens = job.disk_tokens[: good * self.kv.block_size]
            if not good:
                job.done_disk = True
                return
            job.disk_transfer = self.transport.write_device(job.disk_ids, data[:good])  # type: ignore[arg-type]
            job.disk_stage = MoveStage.WRITE
            return
        try:
            job.disk_transfer.result()
            anchor = job.disk_anchor
            if anchor.alive:
                self.radix.insert_below(anchor, job.disk_tokens, job.disk_ids)
                self._count_loaded(job.traj, Tier.DISK, len(job.disk_tokens))
            self.stats.bytes_moved["disk_to_device"] += len(job.disk_ids) * self.block_bytes
        except Exception:
            log.exception("writing disk blocks to the device failed; they will be recomputed")
        self.residency.unpin(Tier.DEVICE, job.disk_ids)
        job.done_disk = True

    def _count_loaded(self, traj: Trajectory, tier: Tier, tokens: int) -> None:
        self.stats.loaded_tokens[tier] += tokens
        per = self.loaded.setdefault(traj.traj_id, dict.fromkeys(OFF_DEVICE, 0))
        per[tier] += tokens

    def take_loaded(self, traj: Trajectory) -> Mapping[Tier, int]:
        """Tokens of ``traj`` loaded back from each tier since the last call."""
        return self.loaded.pop(traj.traj_id, NOTHING_LOADED)

    def forget(self, traj: Trajectory) -> None:
        self.disk_hint.discard(traj.traj_id)
