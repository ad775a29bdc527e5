"""The disk store's I/O path: runs of slots, direct I/O, staging, read buffers, reads into the
caller's buffer, and the index format change of the checksums."""

from __future__ import annotations

import errno
import itertools
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from hashlib import shake_256
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvpilot.store.disk
from kvpilot.errors import InvalidRequest
from kvpilot.store import DiskBlockStore
from kvpilot.store.buffers import ReadBuffers, aligned_buffer, is_aligned
from kvpilot.store.index import INDEX_FILENAME
from kvpilot.store.slot_file import runs
from kvpilot.store.staging import StagedWrites

BLOCK = 4096  # a page: the store uses direct I/O where the file system allows


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int, length: int = BLOCK) -> bytes:
    return shake_256(i.to_bytes(8, "little")).digest(length)


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def direct_io_works(folder: Path) -> bool:
    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    os.close(fd)
    return hasattr(os, "O_DIRECT")


# -- runs of slots --------------------------------------------------------------------------


@given(st.lists(st.tuples(st.integers(0, 40), st.booleans()), max_size=30))
def test_runs_cover_every_pair_once_and_merge_exactly_the_consecutive_ones(
    spec: list[tuple[int, bool]],
) -> None:
    pairs = [(pos, slot) for pos, (slot, _) in enumerate(spec)]
    whole = [w for _, w in spec]
    found = runs(pairs, whole)
    assert [(p + k, s + k) for p, s, n in found for k in range(n)] == pairs
    ends = {p + n - 1 for p, _, n in found}
    for i in range(len(pairs) - 1):  # a run ends exactly where the next pair cannot follow
        follows = pairs[i + 1][1] == pairs[i][1] + 1 and whole[i]
        assert (i in ends) == (not follows)


@given(st.integers(1, 64), st.integers(0, 300))
def test_staging_shares_cover_a_batch_in_order_and_ramp_up_to_a_buffer(
    chunk: int, count: int
) -> None:
    staged = StagedWrites.__new__(StagedWrites)  # the arithmetic only: no buffers, no thread
    staged.chunk = chunk
    shares = staged.chunks(count)
    assert [i for a, b in shares for i in range(a, b)] == list(range(count))
    sizes = [b - a for a, b in shares]
    assert all(1 <= n <= chunk for n in sizes)
    assert all(b >= min(chunk, 2 * a) for a, b in itertools.pairwise(sizes[:-1]))
    if count >= chunk:
        assert sizes[0] <= max(1, chunk // 8)


# -- writes -----------------------------------------------------------------------------------


def test_aligned_slots_go_through_direct_io_where_the_file_system_allows(tmp_path: Path) -> None:
    with DiskBlockStore(tmp_path, 8, BLOCK, fsync=False) as s:
        assert s.put_many([(key(i), block(i)) for i in range(8)]).result() == [True] * 8
        assert [bytes(b or b"") for b in s.get_many([key(i) for i in range(8)])] == [
            block(i) for i in range(8)
        ]
        assert s._file.direct == direct_io_works(tmp_path)
    with DiskBlockStore(tmp_path / "odd", 8, 100, fsync=False) as odd:  # not page-sized
        assert odd.put(key(1), block(1, 100)).result()
        assert odd.get(key(1)) == block(1, 100)
        assert not odd._file.direct


def test_short_blocks_round_trip_through_whole_slot_writes(tmp_path: Path) -> None:
    blocks = {key(i): block(i, 1 + 997 * i % BLOCK) for i in range(12)}
    with DiskBlockStore(tmp_path, 12, BLOCK, fsync=False) as s:
        s.put_many(list(blocks.items())).result()
        assert [bytes(b or b"") for b in s.get_many(list(blocks))] == list(blocks.values())
        assert s.stats.bytes_read == sum(map(len, blocks.values()))


class SlowIOStore(DiskBlockStore):
    """Each chunk's write waits, so the writer fills the other staging buffer meanwhile."""

    chunks: int = 0

    def _write_slots(self, writes: Sequence[tuple[int, memoryview]]) -> None:
        time.sleep(0.02)
        self.chunks += 1
        super()._write_slots(writes)


def test_a_batch_larger_than_the_staging_buffers_round_trips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvpilot.store.disk, "STAGING_BYTES", 2 * BLOCK)
    with SlowIOStore(tmp_path, 64, BLOCK, fsync=True) as s:
        assert s.put_many([(key(i), block(i)) for i in range(11)]).result() == [True] * 11
        assert s.chunks == 6  # 2 + 2 + 2 + 2 + 2 + 1, alternating two buffers
        assert [bytes(b or b"") for b in s.get_many([key(i) for i in range(11)])] == [
            block(i) for i in range(11)
        ]
        assert s.stats.corrupt == 0
        s.check_invariants()


class FailsOnThirdChunk(DiskBlockStore):
    chunks: int = 0

    def _write_slots(self, writes: Sequence[tuple[int, memoryview]]) -> None:
        self.chunks += 1
        if self.chunks == 3:
            raise OSError(5, "Input/output error")
        super()._write_slots(writes)


def test_a_chunk_that_fails_fails_its_whole_batch_and_frees_the_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvpilot.store.disk, "STAGING_BYTES", 2 * BLOCK)
    with FailsOnThirdChunk(tmp_path, 16, BLOCK, fsync=False) as s:
        assert s.put_many([(key(i), block(i)) for i in range(8)]).result() == [False] * 8
        assert len(s) == 0 and s.stats.write_errors == 8
        s.check_invariants()
        assert s.put_many([(key(i), block(i)) for i in range(8)]).result() == [True] * 8
        assert s.get(key(7)) == block(7)
    with sqlite3.connect(tmp_path / INDEX_FILENAME) as conn:
        assert conn.execute("SELECT COUNT(*) FROM blocks").fetchone()[0] == 8


# -- reads ------------------------------------------------------------------------------------


@pytest.mark.parametrize("aligned", [True, False])
def test_read_into_fills_the_callers_buffer_and_reports_lengths(
    tmp_path: Path, aligned: bool
) -> None:
    with DiskBlockStore(tmp_path, 8, BLOCK, fsync=False) as s:
        s.put_many([(key(i), block(i, BLOCK - i)) for i in range(4)]).result()
        out = aligned_buffer(5 * BLOCK) if aligned else memoryview(bytearray(5 * BLOCK + 8))[8:]
        assert is_aligned(out) == aligned
        keys = [key(2), key(0), key(9), key(3), key(1)]
        assert s.read_into(keys, out) == [BLOCK - 2, BLOCK, None, BLOCK - 3, BLOCK - 1]
        for pos, i in ((0, 2), (1, 0), (3, 3), (4, 1)):
            assert bytes(out[pos * BLOCK : pos * BLOCK + BLOCK - i]) == block(i, BLOCK - i)


def test_read_into_refuses_a_small_or_read_only_buffer(tmp_path: Path) -> None:
    with DiskBlockStore(tmp_path, 8, BLOCK, fsync=False) as s:
        with pytest.raises(InvalidRequest, match="writable buffer of at least 2"):
            s.read_into([key(1), key(2)], bytearray(BLOCK))
        with pytest.raises(InvalidRequest, match="read-only"):
            s.read_into([key(1)], memoryview(bytes(BLOCK)))


def test_blocks_held_by_the_caller_are_never_overwritten_by_later_reads(tmp_path: Path) -> None:
    with DiskBlockStore(tmp_path, 64, BLOCK, fsync=False) as s:
        s.put_many([(key(i), block(i)) for i in range(64)]).result()
        held = [s.get_many([key(i), key(i + 32)]) for i in range(32)]
        for i, (a, b) in enumerate(held):
            assert a == block(i) and b == block(i + 32)
        prefilled = kvpilot.store.disk.READ_BUFFERS
        assert s._read_buffers.reused == prefilled  # then a new buffer for every read
        assert s._read_buffers.mapped == 32 - prefilled
        del held
        s.get_many([key(5)])
        assert s._read_buffers.reused == prefilled + 1  # a buffer freed above, mapped already


def test_a_new_stores_first_reads_land_in_buffers_mapped_at_open(tmp_path: Path) -> None:
    with DiskBlockStore(tmp_path, 64, BLOCK, fsync=False) as s:
        s.put_many([(key(i), block(i)) for i in range(64)]).result()
        first = s.get_many([key(i) for i in range(64)])
        second = s.get_many([key(i) for i in range(32)])
        assert first == [block(i) for i in range(64)] and second == first[:32]
        assert (s._read_buffers.mapped, s._read_buffers.reused) == (0, 2)


def test_prefilled_read_buffers_stay_within_the_budget() -> None:
    pool = ReadBuffers(slots=3, max_bytes=4 * BLOCK)
    pool.prefill(2 * BLOCK, 5)
    assert [len(k) for k in pool._kept] == [2 * BLOCK, 2 * BLOCK]
    a, b = pool.take(2 * BLOCK), pool.take(BLOCK)
    assert is_aligned(a) and is_aligned(b) and pool.reused == 2 and pool.mapped == 0


def test_read_buffers_are_reused_only_once_every_view_is_gone() -> None:
    pool = ReadBuffers(slots=2)
    a = pool.take(3 * BLOCK)
    assert is_aligned(a)
    views = [a[i * BLOCK : (i + 1) * BLOCK] for i in range(3)]
    base = address(a)
    del a
    b = pool.take(BLOCK)
    assert address(b) != base  # a view of the first buffer is alive
    del views[:2]
    c = pool.take(BLOCK)
    assert address(c) not in (base, address(b))
    del views
    d = pool.take(2 * BLOCK)
    assert address(d) == base and pool.reused == 1
    assert pool.take(BLOCK).nbytes == BLOCK


def test_reads_and_writes_from_threads_keep_every_block_intact(tmp_path: Path) -> None:
    with DiskBlockStore(tmp_path, 256, BLOCK, fsync=False) as s:
        s.put_many([(key(i), block(i)) for i in range(256)]).result()
        bad: list[int] = []

        def reader(offset: int) -> None:
            for r in range(40):
                ids = [(offset + r + j) % 256 for j in range(8)]
                got = s.get_many([key(i) for i in ids])
                bad.extend(i for i, g in zip(ids, got, strict=True) if g != block(i))

        threads = [threading.Thread(target=reader, args=(t * 50,)) for t in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert bad == []


# -- the checksum change ------------------------------------------------------------------------


def test_a_store_with_the_old_checksums_drops_its_blocks_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with DiskBlockStore(tmp_path, 8, BLOCK, fsync=False) as s:
        s.put(key(1), block(1)).result()
    with sqlite3.connect(tmp_path / INDEX_FILENAME) as conn:
        conn.execute("PRAGMA user_version=1")
    with (
        caplog.at_level(logging.WARNING, logger="kvpilot.store.index"),
        DiskBlockStore(tmp_path, 8, BLOCK, fsync=False) as s,
    ):
        assert len(s) == 0 and s.get(key(1)) is None
        assert s.put(key(2), block(2)).result() and s.get(key(2)) == block(2)
    assert "older kvpilot" in caplog.text
    with sqlite3.connect(tmp_path / INDEX_FILENAME) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 2


def test_read_buffers_keep_at_most_their_budget_and_let_idle_ones_go() -> None:
    pool = ReadBuffers(slots=2, max_bytes=4 * BLOCK)
    a, b = pool.take(BLOCK), pool.take(2 * BLOCK)
    c = pool.take(3 * BLOCK)  # over budget while a and b are held: not kept
    assert len(pool._kept) == 2
    del a
    d = pool.take(3 * BLOCK)  # a's buffer goes to make room... still over budget with b's
    assert len(pool._kept) == 1
    del b, c
    e = pool.take(3 * BLOCK)  # b's goes too; now it fits
    assert [len(k) for k in pool._kept] == [3 * BLOCK]
    del d, e
    assert pool.take(3 * BLOCK) and pool.reused == 1


def test_a_file_system_without_direct_io_gets_buffered_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open
    direct = getattr(os, "O_DIRECT", 0)

    def no_direct(path: object, flags: int, *args: int) -> int:
        if direct and flags & direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    with DiskBlockStore(tmp_path, 8, BLOCK, fsync=True) as s:
        monkeypatch.setattr(os, "open", no_direct)
        assert s.put_many([(key(i), block(i)) for i in range(8)]).result() == [True] * 8
        assert [bytes(b or b"") for b in s.get_many([key(i) for i in range(8)])] == [
            block(i) for i in range(8)
        ]
        assert not s._file.direct
