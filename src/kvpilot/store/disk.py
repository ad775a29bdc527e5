"""The disk tier's block store: fixed-size slots in one data file, an SQLite index, verified reads.

Layout of ``directory``::

    blocks.dat      num_slots * block_bytes (sparse); slot s holds [s * block_bytes, + length)
    index.sqlite3   key -> slot, length, XXH3-128 checksum, created, last_access; geometry
    LOCK            flock'ed while a store has the directory open

Crash safety rests on two rules. A row is committed only after its block's bytes are written
(and fsync'ed), so a row never names bytes that were never written. And every read is checked
against its row's length and checksum, so a row whose slot was later overwritten (a crash between
an evicting write and its commit), truncated, damaged or deleted is a miss, never wrong bytes.

Speed comes from moving whole batches and keeping the disk busy. Three threads form a pipeline:

    writer  plans a batch's slots, copies its blocks into reused page-aligned staging buffers
            (`kvpilot.store.staging`: no page faults per write) and checksums them there (XXH3,
            ~13 GB/s a core; copy and hash without the GIL), then goes on to the next batch
    I/O     writes each buffer, a run of consecutive slots in one ``pwritev`` (direct I/O where
            the slot size allows, `kvpilot.store.slot_file`), buffer after buffer
    sync    per batch, in order: waits for its writes, fsyncs (one fsync covers every batch
            written before it, `kvpilot.store.durable`), commits its rows, then publishes
            them and resolves its puts

so a batch's fsync and index commit overlap the next batch's writes, and a put resolves True
only once its block is durable and indexed. Reads land in one buffer per call (``read_into``
takes the caller's; ``get_many`` takes a reused one, `kvpilot.store.buffers`), a run of
consecutive slots in one ``preadv``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from kvpilot.errors import ConfigError, InvalidRequest, KvpilotError
from kvpilot.memory.hashing import ModelFingerprint
from kvpilot.store.buffers import ReadBuffers
from kvpilot.store.durable import SyncPoints
from kvpilot.store.faults import DISK_FAULTS, FaultEpisodes
from kvpilot.store.index import INDEX_FILENAME, BlockIndex, IndexEntry
from kvpilot.store.slot_file import SlotFile, checksum, lock_directory
from kvpilot.store.slots import Planned, SlotTable, check_key
from kvpilot.store.staging import StagedWrites
from kvpilot.store.stats import DiskStoreStats, StoreCounters, account_reads
from kvpilot.store.writer import BatchWriter

BlockData = bytes | bytearray | memoryview | np.ndarray

log = logging.getLogger(__name__)

STAGING_BYTES = 16 << 20  # the writer's staging buffer: a batch goes to disk in such chunks
READ_BUFFERS = 2  # read buffers of that size mapped at open (a reader holds one, reads another)


@dataclass(frozen=True, slots=True)
class _Put:
    key: bytes
    data: bytes


class DiskBlockStore:
    """Blocks keyed by their 16-byte chained hash, in fixed-size slots on disk.

    ``put`` only queues: background threads write, fsync, then commit the index (group commit
    over everything queued meanwhile), and resolve the returned future with True (stored:
    durable and indexed, or already present) or False (refused or failed). When no slot is
    free, a put evicts the least recently used unpinned block (reads and repeated puts count
    as use); if every stored block is pinned the put is refused with False. Writes are
    best-effort: an I/O error resolves the future with False and counts
    ``stats.write_errors``.

    ``get`` reads on the caller's thread (``get_async`` on a reader thread) and verifies every
    block; a corrupt, truncated or missing block is a miss that drops its row. Blocks come
    back as writable memoryviews of a pooled buffer (they compare equal to the bytes
    written); ``read_into`` fills a buffer of the caller's instead. Pins live in memory
    only. Deletions, dropped rows and access times reach the index with the next write
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
        chunk = max(1, min(num_slots, STAGING_BYTES // block_bytes))
        self._staged = StagedWrites(block_bytes, chunk)
        self._durable = SyncPoints(self._file.sync, lambda: self._staged.completed)
        self._last_written = 0.0  # when the last batch was durable (perf_counter)
        self._sync_thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvpilot-disk-sync"
        )
        self._read_buffers = ReadBuffers()
        self._read_buffers.prefill(chunk * block_bytes, READ_BUFFERS)
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

    def _write_batch(self, items: list[_Put]) -> Future[list[bool]]:
        """Runs on the writer thread: plans slots and stages the blocks (the I/O thread writes
        them); the sync thread then makes them durable, commits their rows and publishes
        them (`_finish_batch`), while this thread goes on to the next batch."""
        now = self._clock()
        with self._lock:
            if items:
                try:
                    self._reconcile_data_file()
                except OSError as exc:
                    self.faults.failed(exc, len(items))
                    self._counters.write_errors += len(items)
                    return self._sync_thread.submit(lambda: [False] * len(items))
            results, planned, evictions = self._slots.plan([p.key for p in items], now)
            self._counters.evictions += evictions
        start = time.perf_counter()
        order = sorted(planned.items(), key=lambda kv: kv[1].slot)
        blocks = [(p.slot, items[p.item].data) for _, p in order]
        sums, written = self._staged.write(blocks, self._write_slots, checksum)
        rows = [
            (key, IndexEntry(slot, len(data), digest, now, now))
            for (key, _), (slot, data), digest in zip(order, blocks, sums, strict=True)
        ]
        return self._sync_thread.submit(self._finish_batch, results, planned, rows, written, start)

    def _finish_batch(
        self,
        results: list[bool],
        planned: dict[bytes, Planned],
        rows: list[tuple[bytes, IndexEntry]],
        written: Future[int],
        start: float,
    ) -> list[bool]:
        """Runs on the sync thread, batch after batch: waits for the batch's writes, fsyncs
        (`SyncPoints`), commits the index, then publishes the rows (reads find them)."""
        try:
            seq = written.result()
            if planned and self._fsync:
                self._durable.make_durable(seq)
            end = time.perf_counter()
            self._commit(rows)
        except DISK_FAULTS as exc:
            self.faults.failed(exc, max(len(planned), 1))
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
                # Batches overlap: this one's time starts when the previous one was done.
                nbytes = sum(entry.length for _, entry in rows)
                self._counters.blocks_written += len(planned)
                self._counters.bytes_written += nbytes
                self._counters.write_bw.observe(nbytes, end - max(start, self._last_written))
                self._last_written = end
        return results

    def _write_slots(self, writes: Sequence[tuple[int, memoryview]]) -> None:
        self._file.write(writes, fsync=False)

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

    def get(self, key: bytes) -> memoryview | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        """Verified reads on the caller's thread into one page-aligned buffer, each block a view
        of it (writable, so ``torch.frombuffer`` takes it without a copy); a block that fails
        verification is a miss (None). The buffer is reused by a later call once every view
        of it is gone (`ReadBuffers`): drop the blocks when done with them."""
        buf = self._read_buffers.take(len(keys) * self.block_bytes)
        lengths = self.read_into(keys, buf)
        b = self.block_bytes
        return [None if n is None else buf[i * b : i * b + n] for i, n in enumerate(lengths)]

    def read_into(self, keys: Sequence[bytes], out: memoryview | bytearray) -> list[int | None]:
        """Reads block ``i`` into ``out[i * block_bytes:]`` and verifies it; returns each
        block's length, None for a miss (absent, or failed verification: its row is dropped).
        ``out`` is writable and at least ``len(keys) * block_bytes`` long; page-aligned (e.g.
        reused pinned staging) lets the disk write straight into it."""
        self._check_open()
        for key in keys:
            check_key(key)
        view = memoryview(out).cast("B")
        if view.readonly or view.nbytes < len(keys) * self.block_bytes:
            raise InvalidRequest(
                f"read_into needs a writable buffer of at least {len(keys)} x "
                f"{self.block_bytes} bytes, got {view.nbytes} bytes"
                + (" (read-only)" if view.readonly else "")
            )
        with self._lock:
            found = [(i, key, self._slots.entries.get(key)) for i, key in enumerate(keys)]
        wanted = [(i, e) for i, _, e in found if e is not None]
        start = time.perf_counter()
        got = self._file.read([(i, e.slot) for i, e in wanted], view) if wanted else []
        b = self.block_bytes
        verdicts = {
            i: (
                "missing"
                if got is None or n < e.length
                else ("ok" if checksum(view[i * b : i * b + e.length]) == e.checksum else "corrupt")
            )
            for (i, e), n in zip(wanted, got or [0] * len(wanted), strict=True)
        }
        elapsed = time.perf_counter() - start
        with self._lock:
            return account_reads(
                self._slots, self._counters, found, verdicts, sum(got or []), elapsed, self._clock()
            )

    def get_async(self, keys: Sequence[bytes]) -> Future[list[memoryview | None]]:
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
            self._writer.close()  # every batch is durable and committed (or failed) now
            self._reader.shutdown(wait=True)
            self._staged.close()
            self._sync_thread.shutdown(wait=True)
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
