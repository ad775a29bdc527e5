"""Pause and resume across memory tiers: decide per pause, move blocks, bring them back.

When a session pauses on a tool call, the policy chooses for the blocks only it holds
(shared blocks stay where their other holders need them): retain, offload to host, offload
to disk, drop, or leave to the prefix cache. Moves run off the step loop; the blocks
involved stay pinned until their copy is done. On resume (or ahead of it, by prefetch at
the predicted return) the trajectory's prefix is made device-resident again: host copies are
swapped in, disk blocks (keyed by the chained block hash) are read back verified, and a
request whose blocks are not back yet waits for them, not the whole engine.

Tokens stay the truth throughout: a block that cannot be moved or read back is simply
recomputed, so every path here is a cost decision, never a correctness one.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpilot.engine.executor import TierTransport, Transfer
from kvpilot.engine.tier_stats import PauseRecord, TierStats
from kvpilot.errors import InvalidRequest, OutOfBlocks
from kvpilot.memory import KVManager, RadixNode, Tier, Trajectory
from kvpilot.memory.hashing import block_hash
from kvpilot.policy.breakeven import PauseAction, PauseDecision, PauseInputs
from kvpilot.policy.meters import PrefillRateMeter, RateMeter, WaitPredictor
from kvpilot.policy.pause import PausePolicy

if TYPE_CHECKING:
    from kvpilot.engine.session import Session
    from kvpilot.store import DiskBlockStore, SessionStore

log = logging.getLogger(__name__)

HASH_BYTES = 16
DEFAULT_PREFILL_TOKENS_PER_S = 2_000.0
DEFAULT_LINK_BYTES_PER_S = 2e9


@dataclass(eq=False, slots=True)
class _Move:
    """Device blocks leaving for host or disk."""

    kind: str  # "host" or "disk"
    transfer: Transfer
    parts: list[tuple[RadixNode, list[int], list[int] | list[bytes]]]  # node, device ids, dest
    nbytes: int
    stage: str = "copy"  # disk: "read" (device -> bytes), then "write" (bytes -> disk)


@dataclass(eq=False, slots=True)
class _Load:
    """A trajectory's prefix coming back to the device."""

    traj: Trajectory
    started: float
    prefetch: bool
    session_id: str | None
    host_parts: list[tuple[RadixNode, list[int], list[int]]]  # node, host ids, device ids
    host_transfer: Transfer | None
    disk_anchor: RadixNode | None  # disk blocks continue the path that ends here
    disk_tokens: list[int]
    disk_keys: list[bytes]
    disk_ids: list[int]
    disk_transfer: Transfer | None = None
    disk_stage: str = "read"
    host_tokens: int = 0
    nbytes_host: int = 0
    done_host: bool = False
    done_disk: bool = False


@dataclass(order=True, slots=True)
class _Timer:
    at: float
    seq: int
    action: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)


class OffloadManager:
    def __init__(
        self,
        kv: KVManager,
        policy: PausePolicy,
        clock: Callable[[], float],
        *,
        transport: TierTransport | None = None,
        disk: DiskBlockStore | None = None,
        session_store: SessionStore | None = None,
        default_wait_s: float = 1.0,
        prefetch: bool = True,
        pressure: Callable[[], float] | None = None,
    ) -> None:
        self.kv = kv
        self.radix = kv.radix
        self.policy = policy
        self.now = clock
        self.transport = transport
        self.disk = disk
        self.session_store = session_store
        self.prefetch_enabled = prefetch
        self.pressure = pressure or (lambda: self.kv.device.usage)
        self.host_pool = kv.pools.get(Tier.HOST)
        self.block_bytes = transport.block_bytes if transport is not None else 0
        self.stats = TierStats()
        self.link = RateMeter()
        self.disk_link = RateMeter()
        self.prefill = PrefillRateMeter()
        self.waits = WaitPredictor(default_wait_s)
        self.records: dict[str, PauseRecord] = {}
        self.moves: list[_Move] = []
        self.loads: dict[int, _Load] = {}
        self.loaded: dict[int, dict[str, int]] = {}  # traj_id -> tokens loaded per tier
        self.disk_hint: set[int] = set()  # trajectories whose blocks may be on disk
        self.high_water: dict[int, int] = {}
        self._timers: list[_Timer] = []
        self._timer_ids = itertools.count()
        self._session_timers: dict[str, list[_Timer]] = {}
        self._last_poll = clock()
        self._idle_holders: Callable[[], list[Session]] = list
        if transport is not None and self.host_pool is not None:
            self._probe_link()
        if transport is not None and disk is not None:
            self._probe_disk()

    # -- measured inputs ---------------------------------------------------------------

    def _probe_link(self) -> None:
        """A short copy out and back at start, so the first decision has a real figure."""
        assert self.transport is not None and self.host_pool is not None
        n = min(8, self.kv.device.num_free, self.host_pool.num_free)
        if n < 1:
            return
        dev = self.kv.device.allocate(n)
        host = self.host_pool.allocate(n)
        try:
            for pairs in (list(zip(dev, host, strict=True)), list(zip(host, dev, strict=True))):
                fn = self.transport.swap_out if pairs[0][0] in dev else self.transport.swap_in
                seconds = fn(pairs).result()
                self.link.observe(n * self.block_bytes, seconds)
        finally:
            self.kv.device.free(dev)
            self.host_pool.free(host)

    def _probe_disk(self) -> None:
        """Write and read back two throwaway blocks to seed the disk bandwidth meter."""
        assert self.disk is not None
        blob = bytes(self.block_bytes or 4096)
        keys = [b"kvpilot-probe-%02d" % i for i in range(2)]
        keys = [k.ljust(HASH_BYTES, b"\0")[:HASH_BYTES] for k in keys]
        self.disk.put_many([(k, blob) for k in keys]).result()
        start = self.now()
        self.disk.get_many(keys)
        del start
        rate = self.disk.stats.read_bw_bytes_s
        if rate:
            self.disk_link.observe(rate, 1.0)
        for k in keys:
            self.disk.delete(k)

    def link_bw(self) -> float:
        if self.transport is None or self.host_pool is None:
            return 0.0
        return self.link.get(DEFAULT_LINK_BYTES_PER_S)

    def disk_bw(self) -> float:
        if self.transport is None or self.disk is None:
            return 0.0
        return self.disk_link.get(self.disk.stats.read_bw_bytes_s or 2e8)

    def observe_step(self, prefill_tokens: int, seconds: float, context_tokens: int) -> None:
        if prefill_tokens > 0:
            self.prefill.observe(prefill_tokens, seconds, context_tokens)

    # -- pausing -----------------------------------------------------------------------

    def exclusive_nodes(self, traj: Trajectory) -> list[RadixNode]:
        """The deepest part of the trajectory's path that no one else locks, deepest first."""
        nodes: list[RadixNode] = []
        node: RadixNode | None = traj.locked_node
        while node is not None and not node.is_root and node.lock_count == 1:
            nodes.append(node)
            node = node.parent
        return nodes

    def held_bytes(self, traj: Trajectory) -> int:
        blocks = sum(n.num_blocks for n in self.exclusive_nodes(traj) if Tier.DEVICE in n.blocks)
        return (blocks + traj.num_private_blocks) * self.kv_block_bytes

    @property
    def kv_block_bytes(self) -> int:
        return self.block_bytes or 1

    def pause(
        self, session: Session, expected_wait_s: float | None = None, tool: str | None = None
    ) -> PauseDecision:
        if session.closed:
            raise InvalidRequest(f"session {session.session_id} is closed")
        if session.active_request is not None:
            raise InvalidRequest(
                f"session {session.session_id} is running turn {session.active_request}; "
                "pause it when the turn has finished"
            )
        if expected_wait_s is not None and (
            not math.isfinite(expected_wait_s) or expected_wait_s < 0
        ):
            raise InvalidRequest("expected_wait_s must be a non-negative number of seconds")
        self._cancel_timers(session.session_id)
        traj = session.traj
        now = self.now()
        if expected_wait_s is None:
            wait, source = self.waits.predict(tool)
        else:
            wait, source = float(expected_wait_s), "hint from the caller"
        nodes = [n for n in self.exclusive_nodes(traj) if Tier.DEVICE in n.blocks]
        tokens = sum(len(n.tokens) for n in nodes) + traj.num_computed_tokens - traj.locked_tokens
        kv_bytes = (sum(n.num_blocks for n in nodes) + traj.num_private_blocks) * (
            self.kv_block_bytes
        )
        host_free = (
            (self.host_pool.num_free + self.radix.evictable_blocks(Tier.HOST)) * self.block_bytes
            if self.host_pool is not None and self.transport is not None
            else 0.0
        )
        inputs = PauseInputs(
            kv_bytes=float(kv_bytes),
            num_tokens=max(tokens, 0),
            expected_wait_s=wait,
            device_host_bw_bytes_s=self.link_bw(),
            host_disk_bw_bytes_s=self.disk_bw(),
            prefill_tokens_per_s=self.prefill.tokens_per_s(
                len(traj.tokens), DEFAULT_PREFILL_TOKENS_PER_S
            ),
            device_pressure=min(1.0, max(0.0, self.pressure())),
            host_pressure=self.host_pool.usage if self.host_pool is not None else 1.0,
            host_free_bytes=float(host_free),
        )
        decision = self.policy.decide(inputs)
        decision = self._feasible(decision)
        lease = self.policy.lease_s(inputs) if decision.action is PauseAction.RETAIN else 0.0
        record = PauseRecord(
            session_id=session.session_id,
            decision=decision,
            inputs=inputs,
            tool=tool,
            wait_source=source,
            paused_at=now,
            expected_return=now + wait,
            lease_until=now + lease,
            state="retained",
        )
        self.records[session.session_id] = record
        self.stats.decisions[str(decision.action)] += 1
        self._apply(session, record, nodes)
        if self.session_store is not None:
            self.session_store.save(
                session.session_id,
                traj.tokens,
                session.salt,
                {"action": str(decision.action), "tool": tool, "expected_wait_s": wait},
            )
        return decision

    def _feasible(self, decision: PauseDecision) -> PauseDecision:
        """A fixed policy may ask for a tier this engine lacks: fall back, and say so."""
        action = decision.action
        if action is PauseAction.OFFLOAD_HOST and self.link_bw() == 0.0:
            why = "no host tier is configured"
        elif action is PauseAction.OFFLOAD_DISK and self.disk_bw() == 0.0:
            why = "no disk tier is configured"
        else:
            return decision
        import dataclasses

        return dataclasses.replace(
            decision, action=PauseAction.DROP, reason=f"drop: {why}; {decision.reason}"
        )

    def _apply(self, session: Session, record: PauseRecord, nodes: list[RadixNode]) -> None:
        traj = session.traj
        action = record.action
        if action is PauseAction.RETAIN:
            record.state = "retained"
            if math.isfinite(record.lease_until):
                self._at(record.lease_until, session.session_id, lambda: self._expire(session))
            return
        traj.release_kv(keep_in_cache=True)
        if action is PauseAction.CACHE:
            record.state = "cached"
        elif action is PauseAction.DROP:
            for node in nodes:
                if node.alive and Tier.DEVICE in node.blocks and node.lock_count == 0:
                    self.radix.drop_copy(node, Tier.DEVICE)
            record.state = "dropped"
        elif action is PauseAction.OFFLOAD_HOST:
            self._swap_out(nodes)
            record.state = "offloaded"
        else:
            self._write_disk(nodes)
            self.disk_hint.add(traj.traj_id)
            record.state = "offloaded"
        if action in (PauseAction.OFFLOAD_HOST, PauseAction.OFFLOAD_DISK) and self.prefetch_enabled:
            reload_s = (
                record.decision.reload_s
                if action is PauseAction.OFFLOAD_HOST
                else record.decision.disk_reload_s
            )
            at = record.expected_return - 2 * reload_s - 0.005
            record.prefetch_at = at
            self._at(at, session.session_id, lambda: self._prefetch(session))

    def _expire(self, session: Session) -> None:
        """A retain lease ran out (ttl): let the prefix cache decide from now on."""
        record = self.records.get(session.session_id)
        if record is None or record.state != "retained" or session.closed:
            return
        if session.active_request is None:
            session.traj.release_kv(keep_in_cache=True)
            record.state = "cached"

    # -- moving out ---------------------------------------------------------------------

    def _alloc_host(self, n: int) -> list[int] | None:
        assert self.host_pool is not None
        if self.host_pool.num_free < n:
            self.radix.evict(n - self.host_pool.num_free, Tier.HOST)
        if self.host_pool.num_free < n:
            return None
        ids = self.host_pool.allocate(n)
        self.kv.pin(Tier.HOST, ids, take_reference=False)
        return ids

    def _swap_out(self, nodes: list[RadixNode]) -> None:
        assert self.transport is not None
        parts: list[tuple[RadixNode, list[int], list[int]]] = []
        for node in nodes:
            if not node.alive or Tier.HOST in node.blocks or node.lock_count > 0:
                continue
            dev = list(node.blocks.get(Tier.DEVICE, ()))
            if not dev:
                continue
            host = self._alloc_host(len(dev))
            if host is None:
                break  # no host room: the rest stays in the device cache (LRU decides)
            self.kv.pin(Tier.DEVICE, dev)
            parts.append((node, dev, host))
        if not parts:
            return
        pairs = [(d, h) for _, dev, host in parts for d, h in zip(dev, host, strict=True)]
        nbytes = len(pairs) * self.block_bytes
        self.moves.append(_Move("host", self.transport.swap_out(pairs), parts, nbytes))  # type: ignore[arg-type]

    def _write_disk(self, nodes: list[RadixNode]) -> None:
        assert self.transport is not None and self.disk is not None
        parts: list[tuple[RadixNode, list[int], list[bytes]]] = []
        for node in nodes:
            if not node.alive or node.lock_count > 0 or Tier.DEVICE not in node.blocks:
                continue
            dev = list(node.blocks[Tier.DEVICE])
            h = node.hashes
            keys = [h[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(len(dev))]
            self.kv.pin(Tier.DEVICE, dev)
            parts.append((node, dev, keys))
        if not parts:
            return
        ids = [d for _, dev, _ in parts for d in dev]
        nbytes = len(ids) * self.block_bytes
        self.moves.append(_Move("disk", self.transport.read_device(ids), parts, nbytes, "read"))  # type: ignore[arg-type]

    def _finish_move(self, move: _Move) -> bool:
        """Advance a move whose transfer is done; True when it is complete."""
        try:
            result = move.transfer.result()
        except Exception:  # a failed copy: keep everything where it was
            log.exception("a %s move failed; the blocks stay on the device", move.kind)
            self._abandon_move(move)
            return True
        if move.kind == "host":
            self.link.observe(move.nbytes, float(result))
            self.stats.bytes_moved["device_to_host"] += move.nbytes
            for node, dev, host in move.parts:
                same = node.alive and node.blocks.get(Tier.DEVICE) == dev
                if same and Tier.HOST not in node.blocks:
                    self.radix.add_copy(node, Tier.HOST, list(host))  # type: ignore[arg-type]
                    self.kv.unpin(Tier.HOST, host, drop_reference=False)  # type: ignore[arg-type]
                    if node.lock_count == 0:
                        self.radix.drop_copy(node, Tier.DEVICE)
                else:
                    self.kv.unpin(Tier.HOST, host)  # type: ignore[arg-type]
                self.kv.unpin(Tier.DEVICE, dev)
            return True
        assert self.disk is not None and self.transport is not None
        if move.stage == "read":
            data: list[bytes] = result
            items = []
            i = 0
            for _, _dev, keys in move.parts:
                for key in keys:
                    items.append((key, data[i]))  # type: ignore[arg-type]
                    i += 1
            move.transfer = self.disk.put_many(items)
            move.stage = "write"
            return False
        ok: list[bool] = result
        self.stats.bytes_moved["device_to_disk"] += move.nbytes
        i = 0
        for node, dev, keys in move.parts:
            written = all(ok[i : i + len(keys)])
            i += len(keys)
            if (
                written
                and node.alive
                and node.blocks.get(Tier.DEVICE) == dev
                and node.lock_count == 0
            ):
                self.radix.drop_copy(node, Tier.DEVICE)
            self.kv.unpin(Tier.DEVICE, dev)
        return True

    def _abandon_move(self, move: _Move) -> None:
        for _, dev, dest in move.parts:
            if move.kind == "host":
                self.kv.unpin(Tier.HOST, dest)  # type: ignore[arg-type]
            self.kv.unpin(Tier.DEVICE, dev)

    # -- bringing back ------------------------------------------------------------------

    def ensure_resident(
        self, traj: Trajectory, *, prefetch: bool = False, session_id: str | None = None
    ) -> bool:
        """True when the trajectory's cached prefix is on the device; else start loading it."""
        job = self.loads.get(traj.traj_id)
        if job is not None:
            if not prefetch and job.prefetch:
                job.prefetch = False
                self.stats.prefetch_stalls += 1
            return False
        if self.transport is None:
            return True
        if not self.radix.cached_blocks(Tier.HOST) and traj.traj_id not in self.disk_hint:
            return True  # nothing lives off the device: the fast path of every admission
        buf = traj.token_array()
        tokens = buf[: max(len(buf) - 1, 0)]
        match = self.radix.match(tokens, traj.salt, record=False, tier=None)
        if match.num_tokens <= traj.num_computed_tokens and traj.traj_id not in self.disk_hint:
            return True
        host_nodes = [n for n in match.path if Tier.DEVICE not in n.blocks]
        disk_keys, disk_tokens = self._disk_probe(
            traj, match.node, match.num_tokens, tokens.tolist()
        )
        if not host_nodes and not disk_keys:
            self.disk_hint.discard(traj.traj_id)
            return True
        need = sum(n.num_blocks for n in host_nodes) + len(disk_keys)
        # Keep the device-resident start of the path from being evicted to make room.
        resident = match.path[: match.path.index(host_nodes[0])] if host_nodes else match.path
        guard = resident[-1] if resident else None
        if guard is not None:
            self.radix.lock(guard)
        try:
            if not self.kv.ensure_free(need):
                return False
            dev = self.kv.device.allocate(need)
        except OutOfBlocks:
            return False
        finally:
            if guard is not None:
                self.radix.unlock(guard)
        self.kv.pin(Tier.DEVICE, dev, take_reference=False)
        host_parts: list[tuple[RadixNode, list[int], list[int]]] = []
        pairs: list[tuple[int, int]] = []
        i = 0
        for node in host_nodes:
            host = list(node.blocks[Tier.HOST])
            ids = dev[i : i + len(host)]
            i += len(host)
            self.kv.pin(Tier.HOST, host)
            host_parts.append((node, host, ids))
            pairs += list(zip(host, ids, strict=True))
        assert self.transport is not None
        job = _Load(
            traj=traj,
            started=self.now(),
            prefetch=prefetch,
            session_id=session_id,
            host_parts=host_parts,
            host_transfer=self.transport.swap_in(pairs) if pairs else None,
            disk_anchor=match.node,
            disk_tokens=disk_tokens,
            disk_keys=disk_keys,
            disk_ids=dev[i:],
            host_tokens=sum(len(n.tokens) for n in host_nodes),
            nbytes_host=len(pairs) * self.block_bytes,
        )
        job.done_host = not pairs
        job.done_disk = not disk_keys
        self.loads[traj.traj_id] = job
        if not prefetch:
            self.stats.prefetch_stalls += 1
        return False

    def _disk_probe(
        self, traj: Trajectory, anchor: RadixNode, matched: int, tokens: list[int]
    ) -> tuple[list[bytes], list[int]]:
        if self.disk is None or traj.traj_id not in self.disk_hint:
            return [], []
        bs = self.kv.block_size
        usable = len(tokens) // bs
        h = anchor.last_hash()
        keys: list[bytes] = []
        for b in range(matched // bs, usable):
            h = block_hash(h, tokens[b * bs : (b + 1) * bs])
            if not self.disk.contains(h):
                break
            keys.append(h)
        return keys, tokens[matched : matched + len(keys) * bs]

    def _advance_load(self, job: _Load) -> bool:
        """Progress a load whose current transfer finished; True when it is complete."""
        if not job.done_host and job.host_transfer is not None and job.host_transfer.done():
            self._finish_host_load(job)
        if job.done_host and not job.done_disk:
            assert self.disk is not None and self.transport is not None
            if job.disk_transfer is None:
                job.disk_transfer = self.disk.get_async(job.disk_keys)
                job.disk_stage = "read"
            elif job.disk_transfer.done():
                self._advance_disk_load(job)
        return job.done_host and job.done_disk

    def _finish_host_load(self, job: _Load) -> None:
        assert job.host_transfer is not None
        try:
            seconds = float(job.host_transfer.result())
            ok = True
        except Exception:
            log.exception("a host-to-device load failed; those blocks will be recomputed")
            seconds, ok = 0.0, False
        self.link.observe(job.nbytes_host, seconds)
        self.stats.bytes_moved["host_to_device"] += job.nbytes_host
        for node, host, ids in job.host_parts:
            if ok and node.alive and Tier.DEVICE not in node.blocks:
                self.radix.add_copy(node, Tier.DEVICE, list(ids))
                self.kv.unpin(Tier.DEVICE, ids, drop_reference=False)
            else:
                self.kv.unpin(Tier.DEVICE, ids)
            self.kv.unpin(Tier.HOST, host)
        if ok:
            self._count_loaded(job.traj, "host", job.host_tokens)
        job.done_host = True

    def _advance_disk_load(self, job: _Load) -> None:
        assert job.disk_transfer is not None and self.transport is not None
        if job.disk_stage == "read":
            data: list[bytes | None] = job.disk_transfer.result()
            good = 0
            while good < len(data) and data[good] is not None:
                good += 1
            self.stats.disk_misses += len(data) - good
            spare = job.disk_ids[good:]
            if spare:
                self.kv.unpin(Tier.DEVICE, spare)
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
            ok = True
        except Exception:
            log.exception("writing disk blocks to the device failed; they will be recomputed")
            seconds, ok = 0.0, False
        nbytes = len(job.disk_ids) * self.block_bytes
        self.disk_link.observe(nbytes, seconds)
        self.stats.bytes_moved["disk_to_device"] += nbytes
        anchor = job.disk_anchor
        if ok and anchor is not None and (anchor.alive or anchor.is_root):
            self.radix.insert_below(anchor, job.disk_tokens, job.disk_ids)
            self._count_loaded(job.traj, "disk", len(job.disk_tokens))
        self.kv.unpin(Tier.DEVICE, job.disk_ids)
        job.done_disk = True

    def _count_loaded(self, traj: Trajectory, tier: str, tokens: int) -> None:
        self.stats.loaded_tokens[tier] += tokens
        per = self.loaded.setdefault(traj.traj_id, {"host": 0, "disk": 0})
        per[tier] += tokens

    def take_loaded(self, traj: Trajectory) -> dict[str, int]:
        return self.loaded.pop(traj.traj_id, {"host": 0, "disk": 0})

    def _prefetch(self, session: Session) -> None:
        record = self.records.get(session.session_id)
        if record is None or session.closed or record.state != "offloaded":
            return
        if session.active_request is not None:
            return
        record.state = "loading"
        if self.ensure_resident(session.traj, prefetch=True, session_id=session.session_id):
            session.traj.reuse_prefix(record=False)
            record.state = "prefetched"

    # -- resume -------------------------------------------------------------------------

    def on_resume(self, session: Session) -> None:
        """A paused session's next turn arrived: learn the wait, score the prefetch."""
        record = self.records.pop(session.session_id, None)
        self._cancel_timers(session.session_id)
        if record is None:
            return
        self.waits.observe(record.tool, self.now() - record.paused_at)
        if record.action in (PauseAction.OFFLOAD_HOST, PauseAction.OFFLOAD_DISK):
            job = self.loads.get(session.traj.traj_id)
            if record.state == "prefetched" and job is None:
                self.stats.prefetch_hits += 1
            elif job is not None and job.prefetch:
                job.prefetch = False
                self.stats.prefetch_stalls += 1

    def record_for(self, session_id: str) -> PauseRecord | None:
        return self.records.get(session_id)

    # -- the step loop's hooks ------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self.moves or self.loads)

    def poll(self, idle: list[Session]) -> None:
        """Finish transfers that are done, fire due timers, account idle memory-time."""
        now = self.now()
        dt = now - self._last_poll
        self._last_poll = now
        if dt > 0 and self.block_bytes:
            held = sum(self.held_bytes(s.traj) for s in idle)
            self.stats.idle_gb_s += held * dt / 1e9
        still: list[_Move] = []
        for move in self.moves:
            if not (move.transfer.done() and self._finish_move(move)):
                still.append(move)
        self.moves = still
        for traj_id, job in list(self.loads.items()):
            if self._advance_load(job):
                del self.loads[traj_id]
                self.stats.reload_s.append(self.now() - job.started)
                if job.prefetch and not job.traj.closed:
                    job.traj.reuse_prefix(record=False)
                    record = self.records.get(job.session_id or "")
                    if record is not None and record.state == "loading":
                        record.state = "prefetched"
        while self._timers and self._timers[0].at <= now:
            timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                timer.action()

    def reclaim(self, idle: list[Session], blocks_wanted: int) -> int:
        """Memory pressure: demote the idle trajectory worth least per byte it holds.

        Value is taken as nearness of return: the one expected back last goes first
        (never-paused idle sessions count from when they were last used). Its blocks go to
        host when there is room and reloading beats recomputing, else back to the cache.
        """
        holders = [s for s in idle if s.traj.num_computed_tokens and self.held_bytes(s.traj)]
        if not holders:
            return 0
        now = self.now()

        def next_use(s: Session) -> float:
            record = self.records.get(s.session_id)
            return record.expected_return if record is not None else now + (now - s.last_used)

        victim = max(holders, key=next_use)
        nodes = [n for n in self.exclusive_nodes(victim.traj) if Tier.DEVICE in n.blocks]
        victim.traj.release_kv(keep_in_cache=True)
        record = self.records.get(victim.session_id)
        if record is not None:
            record.state = "cached"
        if self.transport is not None and self.host_pool is not None and nodes:
            self._swap_out(nodes)
            # The step loop needs the blocks now: wait for this (short) copy.
            for move in list(self.moves):
                move.transfer.result()
            self.poll(idle=[])
        self.stats.decisions["demoted"] += 1
        return 1

    # -- timers ---------------------------------------------------------------------------

    def _at(self, at: float, session_id: str, action: Callable[[], None]) -> None:
        timer = _Timer(at, next(self._timer_ids), action)
        heapq.heappush(self._timers, timer)
        self._session_timers.setdefault(session_id, []).append(timer)

    def _cancel_timers(self, session_id: str) -> None:
        for timer in self._session_timers.pop(session_id, []):
            timer.cancelled = True

    def next_event_at(self) -> float | None:
        live = [t.at for t in self._timers if not t.cancelled]
        return min(live) if live else None

    def forget(self, session: Session) -> None:
        self._cancel_timers(session.session_id)
        self.records.pop(session.session_id, None)
        self.disk_hint.discard(session.traj.traj_id)
        self.high_water.pop(session.traj.traj_id, None)
        if self.session_store is not None:
            self.session_store.delete(session.session_id)

    def close(self) -> None:
        for move in self.moves:
            with contextlib.suppress(Exception):
                move.transfer.result()
        if self.disk is not None:
            self.disk.close()
        if self.session_store is not None:
            self.session_store.close()

    def describe(self) -> dict[str, Any]:
        return {
            "link_bw_bytes_s": self.link_bw(),
            "disk_bw_bytes_s": self.disk_bw(),
            "host_blocks": self.host_pool.num_blocks if self.host_pool is not None else 0,
            "host_used": self.host_pool.num_used if self.host_pool is not None else 0,
            "disk_blocks": len(self.disk) if self.disk is not None else 0,
            **self.stats.as_dict(),
        }
