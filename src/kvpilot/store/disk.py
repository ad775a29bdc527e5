"""The disk tier's block store: fixed-size slots in one data file, an SQLite index, verified reads.

Layout of ``directory``::

    blocks.dat      num_slots * block_bytes (sparse); slot s holds [s * block_bytes, + length)
    index.sqlite3   key -> slot, length, blake2b-16 checksum, created, last_access; geometry
    LOCK            flock'ed while a store has the directory open

Crash safety rests on two rules. A row is committed only after its block's bytes are written
(and fsync'ed), so a row never names bytes that were never written. And every read is checked
against its row's length and checksum, so a row whose slot was later overwritten (a crash between
an evicting write and its commit), truncated, damaged or deleted is a miss, never wrong bytes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from kvpilot.errors import ConfigError, KvpilotError
from kvpilot.memory.hashing import ModelFingerprint
from kvpilot.store.faults import DISK_FAULTS, FaultEpisodes
from kvpilot.store.index import INDEX_FILENAME, BlockIndex, IndexEntry
from kvpilot.store.slot_file import SlotFile, checksum, lock_directory
from kvpilot.store.slots import SlotTable, check_key
from kvpilot.store.stats import DiskStoreStats, StoreCounters
from kvpilot.store.writer import BatchWriter

BlockData = bytes | bytearray | memoryview | np.ndarray

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Put:
    key: bytes
    data: bytes


@dataclass(slots=True)
class _Planned:
    slot: int
    data: bytes
    item: int


class DiskBlockStore:
    """Blocks keyed by their 16-byte chained hash, in fixed-size slots on disk.

    ``put`` only queues: a background writer thread writes, fsyncs, then commits the index
    (group commit over everything queued meanwhile), and resolves the returned future with True
    (stored, or already present) or False (refused or failed). When no slot is free, a put
    evicts the least recently used unpinned block (reads and repeated puts count as use); if
    every stored block is pinned the put is refused with False. Writes are best-effort: an I/O
    error resolves the future with False and counts ``stats.write_errors``.

    ``get`` reads on the caller's thread (``get_async`` on a reader thread) and verifies every
    block; a corrupt, truncated or missing block is a miss that drops its row. Pins live in
    memory only. Deletions, dropped rows and access times reach the index with the next write
    batch, ``flush`` or ``close``.
    """

    def __init__(
        self,
        directory: Path | str,
        num_slots: int,
        block_bytes: int,
        *,
        create: bool = True,
        fsync: bool = True,
        max_batch_blocks: int = 256,
        clock: Callable[[], float] = time.time,
        model: ModelFingerprint | None = None,
    ) -> None:
        if num_slots < 1 or block_bytes < 1:
            raise ConfigError(
                f"num_slots and block_bytes must be >= 1, got {num_slots} and {block_bytes}"
            )
        self.directory = Path(directory)
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self._fsync = fsync
        self._clock = clock
        if not self.directory.is_dir():
            if not create:
                raise ConfigError(
                    f"no disk block store at {self.directory}; pass create=True to start one"
                )
            self.directory.mkdir(parents=True)
        self._file = SlotFile(self.directory, num_slots, block_bytes)
        self._file.check_space()
        self._lock_fd = lock_directory(self.directory)
        try:
            self._index = BlockIndex(
                self.directory / INDEX_FILENAME,
                num_slots=num_slots,
                block_bytes=block_bytes,
                create=create,
                model=model,
            )
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._lock = threading.Lock()
        self._slots = SlotTable(num_slots, self._index.load())
        self._counters = StoreCounters()
        self.faults = FaultEpisodes(f"writing KV blocks to {self.directory}", log)
        self._closed = False
        try:
            with self._lock:
                self._reconcile_data_file()
        except BaseException:
            self._index.close()
            os.close(self._lock_fd)
            raise
        self._writer: BatchWriter[_Put, bool] = BatchWriter(
            self._write_batch, name="kvpilot-disk-writer", max_batch=max_batch_blocks
        )
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpilot-disk-reader")

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: bytes, data: BlockData) -> Future[bool]:
        """Queues one block; never waits for disk. The data is copied before this returns."""
        self._check_open()
        return self._writer.submit_one(self._prepare(key, data))

    def put_many(self, items: Iterable[tuple[bytes, BlockData]]) -> Future[list[bool]]:
        self._check_open()
        return self._writer.submit([self._prepare(k, d) for k, d in items])

    def flush(self) -> None:
        """Waits until every queued put is written and the index (deletions too) is committed."""
        self._check_open()
        self._writer.submit([]).result()

    def _prepare(self, key: bytes, data: BlockData) -> _Put:
        check_key(key)
        raw = np.ascontiguousarray(data).tobytes() if isinstance(data, np.ndarray) else bytes(data)
        if len(raw) > self.block_bytes:
            raise ConfigError(
                f"a {len(raw)}-byte block does not fit this store's {self.block_bytes}-byte "
                "slots; open the disk store with block_bytes equal to the KV block size"
            )
        return _Put(key, raw)

    def _write_batch(self, items: list[_Put]) -> list[bool]:
        """Runs on the writer thread: plan slots, write and fsync, commit rows, then publish."""
        now = self._clock()
        with self._lock:
            if items:
                try:
                    self._reconcile_data_file()
                except OSError as exc:
                    self.faults.failed(exc, len(items))
                    self._counters.write_errors += len(items)
                    return [False] * len(items)
            results, planned = self._plan(items, now)
        start = time.perf_counter()
        rows = [
            (key, IndexEntry(p.slot, len(p.data), checksum(p.data), now, now))
            for key, p in planned.items()
        ]
        nbytes = sum(len(p.data) for p in planned.values())
        try:
            if planned:
                self._write_slots([(p.slot, p.data) for p in planned.values()])
            elapsed = time.perf_counter() - start
            self._commit(rows)
        except DISK_FAULTS as exc:
            self.faults.failed(exc, max(len(rows), 1))
            with self._lock:
                for p in planned.values():
                    self._slots.abandoned(p.slot)
                    results[p.item] = False
                self._counters.write_errors += len(planned)
            return results
        if planned:
            self.faults.succeeded()
        with self._lock:
            for key, entry in rows:
                self._slots.written(key, entry)
            if planned:
                self._counters.blocks_written += len(planned)
                self._counters.bytes_written += nbytes
                self._counters.write_bw.observe(nbytes, elapsed)
        return results

    def _plan(
        self, items: list[_Put], now: float
    ) -> tuple[list[bool], OrderedDict[bytes, _Planned]]:
        """Caller holds the lock. Items go in order: a later item may evict an earlier one."""
        results = [True] * len(items)
        planned: OrderedDict[bytes, _Planned] = OrderedDict()
        for i, put in enumerate(items):
            if put.key in self._slots.entries:
                self._slots.touch(put.key, now)
                continue
            if put.key in planned:
                continue
            slot = self._take_slot(planned)
            if slot is None:
                results[i] = False
                continue
            planned[put.key] = _Planned(slot, put.data, i)
        return results, planned

    def _take_slot(self, planned: OrderedDict[bytes, _Planned]) -> int | None:
        slot = self._slots.take_free()
        if slot is not None:
            return slot
        slot = self._slots.evict_lru()
        if slot is None and planned:
            slot = planned.popitem(last=False)[1].slot
        if slot is None:
            return None
        self._counters.evictions += 1
        return slot

    def _write_slots(self, writes: Sequence[tuple[int, bytes]]) -> None:
        self._file.write(writes, fsync=self._fsync)

    def _commit(self, inserts: Sequence[tuple[bytes, IndexEntry]] = ()) -> None:
        with self._lock:
            deletes, touches = self._slots.take_changes()
        if not (deletes or inserts or touches):
            return
        try:
            self._index.commit(deletes=deletes, inserts=inserts, touches=touches)
        except BaseException:
            with self._lock:
                self._slots.give_back(deletes, touches)
            raise

    # -- reads ----------------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Verified reads on the caller's thread; a block that fails verification is a miss."""
        self._check_open()
        for key in keys:
            check_key(key)
        with self._lock:
            found = [(i, key, self._slots.entries.get(key)) for i, key in enumerate(keys)]
        wanted = sorted(((i, k, e) for i, k, e in found if e is not None), key=lambda t: t[2].slot)
        raw: dict[int, bytes] = {}
        start = time.perf_counter()
        if wanted:
            blocks = self._file.read([(e.slot, e.length) for _, _, e in wanted])
            if blocks is not None:
                raw = {i: data for (i, _, _), data in zip(wanted, blocks, strict=True)}
        verdicts = {
            i: (
                "missing"
                if i not in raw or len(raw[i]) < entry.length
                else ("ok" if checksum(raw[i]) == entry.checksum else "corrupt")
            )
            for i, _, entry in wanted
        }
        elapsed = time.perf_counter() - start
        out: list[bytes | None] = [None] * len(keys)
        now = self._clock()
        with self._lock:
            c = self._counters
            if wanted:
                c.read_bw.observe(sum(len(b) for b in raw.values()), elapsed)
            for i, key, entry in found:
                verdict = "absent" if entry is None else verdicts[i]
                if verdict == "ok":
                    out[i] = raw[i]
                    c.hits += 1
                    c.blocks_read += 1
                    c.bytes_read += len(raw[i])
                    if self._slots.entries.get(key) is entry:
                        self._slots.touch(key, now)
                    continue
                c.misses += 1
                # A block evicted or dropped while we read it is a plain miss, not damage.
                if verdict != "absent" and self._slots.entries.get(key) is entry:
                    self._slots.drop(key)
                    if verdict == "corrupt":
                        c.corrupt += 1
                    else:
                        c.missing += 1
        return out

    def get_async(self, keys: Sequence[bytes]) -> Future[list[bytes | None]]:
        """``get_many`` on the reader thread (e.g. a prefetch ahead of a predicted resume)."""
        self._check_open()
        return self._reader.submit(self.get_many, list(keys))

    # -- index ----------------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """Index only (no read): a True may still turn into a miss if the data is damaged."""
        with self._lock:
            return key in self._slots.entries

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.contains(key)

    def __len__(self) -> int:
        return len(self._slots.entries)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            if key not in self._slots.entries:
                return False
            self._slots.drop(key)
            return True

    def pin(self, key: bytes) -> bool:
        """Protects a stored block from eviction (counted: unpin as many times). False if absent."""
        with self._lock:
            return self._slots.pin(key)

    def unpin(self, key: bytes) -> None:
        with self._lock:
            self._slots.unpin(key)

    @property
    def stats(self) -> DiskStoreStats:
        with self._lock:
            return self._counters.snapshot(
                blocks_stored=len(self._slots.entries),
                num_slots=self.num_slots,
                queued_writes=self._writer.pending,
            )

    def check_invariants(self) -> None:
        """Every slot is exactly one of: free, in flight, or held by one stored block."""
        with self._lock:
            self._slots.check_invariants(self.block_bytes)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Finishes queued puts, commits the index, stops the threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._writer.close()
            self._reader.shutdown(wait=True)
            try:
                self._commit()
            except DISK_FAULTS as exc:  # the index keeps its last good state
                self.faults.failed(exc)
        finally:
            self._index.close()
            os.close(self._lock_fd)

    def __enter__(self) -> DiskBlockStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals (caller holds self._lock) ----------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise KvpilotError(f"disk store at {self.directory} is closed")

    def _reconcile_data_file(self) -> None:
        """Drops the rows whose data is gone (file deleted or cut short), then restores the file."""
        size = self._file.size()
        lost = [
            key
            for key, e in self._slots.entries.items()
            if size is None or e.slot * self.block_bytes + e.length > size
        ]
        for key in lost:
            self._slots.drop(key)
        self._counters.missing += len(lost)
        if size is None or size < self._file.full_size:
            self._file.restore()
