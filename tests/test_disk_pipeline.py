"""The disk store's write pipeline: the next batch is staged and written while the last one is
fsynced and committed, a batch is "stored" only once durable, fsyncs are shared, and a failed
fsync fails every batch whose writes it may have lost."""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from hashlib import shake_256
from pathlib import Path

import pytest

import kvpilot.store.disk
from kvpilot.store import DiskBlockStore
from kvpilot.store.durable import SyncPoints
from kvpilot.store.writer import BatchWriter

BLOCK = 4096


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int) -> bytes:
    return shake_256(i.to_bytes(8, "little")).digest(BLOCK)


def until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


class GatedSync:
    """Stands in for the data file's fsync: each call waits for the gate, and the calls listed
    in ``fail`` (0-based) raise EIO instead of syncing."""

    def __init__(self, real: Callable[[], None], fail: Sequence[int] = ()) -> None:
        self.real = real
        self.fail = set(fail)
        self.gate = threading.Event()
        self.calls = 0
        self.waiting = threading.Event()

    def __call__(self) -> None:
        n = self.calls
        self.calls += 1
        self.waiting.set()
        assert self.gate.wait(timeout=30)
        if n in self.fail:
            raise OSError(errno.EIO, "Input/output error")
        self.real()


def gated_store(
    tmp_path: Path, sync: Callable[[Callable[[], None]], GatedSync]
) -> tuple[DiskBlockStore, GatedSync]:
    s = DiskBlockStore(tmp_path, 64, BLOCK, fsync=True, max_batch_blocks=2)
    gated = sync(s._file.sync)
    s._durable._sync = gated
    return s, gated


def put_batch(s: DiskBlockStore, ids: Sequence[int]) -> Future[list[bool]]:
    return s.put_many([(key(i), block(i)) for i in ids])


# -- the pipeline -------------------------------------------------------------------------------


def test_the_next_batch_is_written_while_the_last_one_waits_for_its_fsync(tmp_path: Path) -> None:
    s, sync = gated_store(tmp_path, GatedSync)
    try:
        first = put_batch(s, [0, 1])
        assert sync.waiting.wait(timeout=10)  # the first batch's fsync has started
        second = put_batch(s, [2, 3])
        # The second batch reaches the disk while the first one's fsync is still held.
        assert until(lambda: s._staged.completed == 2)
        assert not first.done() and not second.done()
        assert not s.contains(key(0)) and s.get(key(0)) is None  # not durable: not stored
        sync.gate.set()
        assert first.result() == [True, True] and second.result() == [True, True]
        assert [s.get(key(i)) for i in range(4)] == [block(i) for i in range(4)]
        s.check_invariants()
    finally:
        sync.gate.set()
        s.close()


def test_batches_written_during_an_fsync_share_the_next_one(tmp_path: Path) -> None:
    s, sync = gated_store(tmp_path, GatedSync)
    try:
        futures = [put_batch(s, [0, 1])]
        assert sync.waiting.wait(timeout=10)
        futures += [put_batch(s, [2 * b, 2 * b + 1]) for b in range(1, 5)]
        assert until(lambda: s._staged.completed == 5)
        sync.gate.set()
        assert [f.result() for f in futures] == [[True, True]] * 5
        assert sync.calls == 2  # the first batch's, then one for the four written meanwhile
    finally:
        sync.gate.set()
        s.close()


def test_a_failed_fsync_fails_the_batches_written_before_it_returned(tmp_path: Path) -> None:
    s, sync = gated_store(tmp_path, lambda real: GatedSync(real, fail=[0]))
    try:
        first = put_batch(s, [0, 1])
        assert sync.waiting.wait(timeout=10)
        second = put_batch(s, [2, 3])  # written while the fsync that will fail runs
        assert until(lambda: s._staged.completed == 2)
        sync.gate.set()
        assert first.result() == [False, False]
        assert second.result() == [False, False]  # a later fsync would not prove it durable
        assert put_batch(s, [4, 5]).result() == [True, True]
        assert [s.contains(key(i)) for i in range(6)] == [False] * 4 + [True] * 2
        assert s.stats.write_errors == 4
        s.check_invariants()
    finally:
        sync.gate.set()
        s.close()


def test_a_batch_behind_a_busy_disk_is_staged_in_whole_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvpilot.store.disk, "STAGING_BYTES", 16 * BLOCK)
    shares: list[int] = []

    class Slow(DiskBlockStore):
        def _write_slots(self, writes: Sequence[tuple[int, memoryview]]) -> None:
            time.sleep(0.03)  # the second batch is planned while the first is still written
            shares.append(len(writes))
            super()._write_slots(writes)

    with Slow(tmp_path, 128, BLOCK, fsync=False, max_batch_blocks=40) as s:
        first = put_batch(s, range(40))  # the disk is idle: it starts small
        second = put_batch(s, range(40, 80))  # the disk is busy: whole buffers only
        assert first.result() == [True] * 40 and second.result() == [True] * 40
    assert shares == [2, 4, 8, 16, 10, 16, 16, 8]  # idle: ramp up; busy: whole buffers


# -- SyncPoints ---------------------------------------------------------------------------------


def test_sync_points_fsync_once_for_everything_completed_before_the_fsync() -> None:
    calls: list[int] = []
    completed = [3]
    points = SyncPoints(lambda: calls.append(completed[0]), lambda: completed[0])
    points.make_durable(2)
    points.make_durable(3)  # covered by the fsync for 2: shares 1-3 had completed
    assert calls == [3]
    completed[0] = 5
    points.make_durable(5)
    assert calls == [3, 5] and points.synced == 5


def test_sync_points_never_vouch_for_writes_a_failed_fsync_may_have_dropped() -> None:
    completed = [2]

    def sync() -> None:
        completed[0] = 4  # shares 3-4 complete while the fsync runs, and it fails
        raise OSError(errno.EIO, "Input/output error")

    points = SyncPoints(sync, lambda: completed[0])
    with pytest.raises(OSError):
        points.make_durable(2)
    points._sync = lambda: None
    for seq in (1, 2, 3, 4):
        with pytest.raises(OSError, match="fsync after this batch"):
            points.make_durable(seq)
    completed[0] = 5
    points.make_durable(5)
    assert points.synced == 5


# -- BatchWriter --------------------------------------------------------------------------------


class SlowCallbacks(Future[list[int]]):
    """Tells its waiters it is done a while before it runs its callbacks (as `Future` does,
    only slower): what resolves a batch's jobs runs in that window."""

    def _invoke_callbacks(self) -> None:
        time.sleep(0.1)
        super()._invoke_callbacks()  # type: ignore[misc]  # not in the stubs


def test_batch_writer_close_waits_until_every_batchs_jobs_are_resolved() -> None:
    def process(items: list[int]) -> Future[list[int]]:
        done = SlowCallbacks()
        threading.Timer(0.1, lambda: done.set_result([i * 10 for i in items])).start()
        return done

    writer: BatchWriter[int, int] = BatchWriter(process, name="test-writer")
    job = writer.submit([1, 2])
    single = writer.submit_one(3)
    writer.close()
    assert job.done() and single.done() and writer.pending == 0
    assert [*job.result(), single.result()] == [10, 20, 30]
