"""The disk tier's block store: verified reads, restart safety, eviction, background writes."""

from __future__ import annotations

import itertools
import os
import sqlite3
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from hashlib import shake_256
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.errors import ConfigError, InvalidRequest, KvpilotError
from kvpilot.memory.hashing import chain_hashes
from kvpilot.store import DiskBlockStore
from kvpilot.store.index import INDEX_FILENAME
from kvpilot.store.slot_file import DATA_FILENAME

from kill import sigkill_when_ready

BLOCK_BYTES = 4096


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int, length: int = BLOCK_BYTES) -> bytes:
    return shake_256(i.to_bytes(8, "little")).digest(length)


def open_store(path: Path, num_slots: int = 64, **kwargs: object) -> DiskBlockStore:
    return DiskBlockStore(path, num_slots, BLOCK_BYTES, fsync=False, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DiskBlockStore]:
    with open_store(tmp_path / "disk") as s:
        yield s
        s.check_invariants()


def fill(s: DiskBlockStore, ids: Sequence[int]) -> None:
    assert s.put_many([(key(i), block(i)) for i in ids]).result() == [True] * len(ids)


def slot_offset(s: DiskBlockStore, k: bytes) -> int:
    return s._slots.entries[k].slot * s.block_bytes


class GatedStore(DiskBlockStore):
    """Its writer waits at the data file until the test opens the gate."""

    gate: threading.Event

    def _write_slots(self, writes: Sequence[tuple[int, bytes]]) -> None:
        assert self.gate.wait(timeout=30)
        super()._write_slots(writes)


class RowCheckingStore(DiskBlockStore):
    """Records whether any key being written already had an index row on disk."""

    early_rows: int = 0

    def _write_slots(self, writes: Sequence[tuple[int, bytes]]) -> None:
        with sqlite3.connect(self.directory / INDEX_FILENAME) as conn:
            self.early_rows += conn.execute("SELECT COUNT(*) FROM blocks").fetchone()[0]
        super()._write_slots(writes)


class FailingStore(DiskBlockStore):
    def _write_slots(self, writes: Sequence[tuple[int, bytes]]) -> None:
        raise OSError(28, "No space left on device")


# -- round trip ---------------------------------------------------------------------------------


def test_round_trip_of_many_blocks_returns_the_same_bytes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    blocks = {key(i): rng.bytes(int(rng.integers(1, BLOCK_BYTES + 1))) for i in range(300)}
    with open_store(tmp_path, num_slots=300) as s:
        futures = [s.put(k, v) for k, v in blocks.items()]
        s.flush()
        assert all(f.done() and f.result() for f in futures)
        assert s.get_many(list(blocks)) == list(blocks.values())
        stats = s.stats
        total = sum(map(len, blocks.values()))
        assert (stats.blocks_written, stats.bytes_written) == (300, total)
        assert (stats.blocks_read, stats.bytes_read, stats.hits) == (300, total, 300)
        assert stats.read_bw_bytes_s > 0 and stats.write_bw_bytes_s > 0
        s.check_invariants()


def test_put_accepts_bytes_memoryview_and_numpy_arrays(store: DiskBlockStore) -> None:
    arr = np.arange(512, dtype=np.float16).reshape(2, 256)
    strided = np.arange(64, dtype=np.int32)[::2]
    assert store.put(key(1), arr).result()
    assert store.put(key(2), memoryview(b"view")).result()
    assert store.put(key(3), bytearray(b"ba")).result()
    assert store.put(key(4), strided).result()
    assert np.array_equal(np.frombuffer(store.get(key(1)) or b"", np.float16).reshape(2, 256), arr)
    assert store.get(key(2)) == b"view"
    assert store.get(key(3)) == b"ba"
    assert store.get(key(4)) == strided.tobytes()


def test_get_of_an_unknown_key_is_a_miss(store: DiskBlockStore) -> None:
    assert store.get(key(7)) is None
    assert not store.contains(key(7))
    assert store.stats.misses == 1 and store.stats.corrupt == 0


def test_get_async_reads_on_the_reader_thread(store: DiskBlockStore) -> None:
    fill(store, range(5))
    assert store.get_async([key(i) for i in (4, 9, 0)]).result() == [block(4), None, block(0)]


def test_bandwidth_estimates_follow_transfers(store: DiskBlockStore) -> None:
    assert store.stats.read_bw_bytes_s == 0.0 and store.stats.write_bw_bytes_s == 0.0
    fill(store, range(16))
    written = store.stats.write_bw_bytes_s
    assert written > 0 and store.stats.read_bw_bytes_s == 0.0
    store.get_many([key(i) for i in range(16)])
    assert store.stats.read_bw_bytes_s > 0
    fill(store, range(16, 32))
    assert store.stats.write_bw_bytes_s != written


# -- damage is a miss, never wrong bytes --------------------------------------------------------


def test_a_flipped_byte_is_a_corrupt_miss_that_drops_the_row(tmp_path: Path) -> None:
    with open_store(tmp_path) as s:
        fill(s, range(3))
        offset = slot_offset(s, key(1)) + 1234
        with open(tmp_path / DATA_FILENAME, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x01]))
        assert s.get_many([key(0), key(1), key(2)]) == [block(0), None, block(2)]
        assert (s.stats.corrupt, s.stats.misses, s.stats.hits) == (1, 1, 2)
        assert not s.contains(key(1))
        assert s.get(key(1)) is None
        assert s.stats.corrupt == 1
    with open_store(tmp_path) as s:
        assert not s.contains(key(1)) and len(s) == 2


def test_a_truncated_data_file_makes_the_blocks_past_the_end_missing(tmp_path: Path) -> None:
    with open_store(tmp_path) as s:
        fill(s, range(8))
        cut = slot_offset(s, key(5)) + 100
        past_end = {i for i in range(8) if slot_offset(s, key(i)) + BLOCK_BYTES > cut}
        os.truncate(tmp_path / DATA_FILENAME, cut)
        got = s.get_many([key(i) for i in range(8)])
        assert got == [None if i in past_end else block(i) for i in range(8)]
        assert 5 in past_end and s.stats.missing == len(past_end) and s.stats.corrupt == 0
        fill(s, range(100, 104))
        assert s.get_many([key(i) for i in range(100, 104)]) == [block(i) for i in range(100, 104)]
        s.check_invariants()


def test_blocks_past_the_end_of_a_truncated_file_are_dropped_on_reopen(tmp_path: Path) -> None:
    with open_store(tmp_path) as s:
        fill(s, range(8))
        ends = {i: slot_offset(s, key(i)) + BLOCK_BYTES for i in range(8)}
    cut = sorted(ends.values())[3]
    os.truncate(tmp_path / DATA_FILENAME, cut)
    with open_store(tmp_path) as s:
        kept = {i for i, end in ends.items() if end <= cut}
        assert {i for i in range(8) if s.contains(key(i))} == kept
        assert s.stats.missing == 8 - len(kept)
        assert all(s.get(key(i)) == block(i) for i in kept)


def test_a_deleted_data_file_makes_blocks_missing_and_the_store_keeps_working(
    tmp_path: Path,
) -> None:
    with open_store(tmp_path) as s:
        fill(s, range(4))
        (tmp_path / DATA_FILENAME).unlink()
        assert s.get_many([key(i) for i in range(4)]) == [None] * 4
        assert s.stats.missing == 4 and len(s) == 0
        fill(s, range(10, 14))
        assert s.get(key(12)) == block(12)
        s.check_invariants()


def test_a_deleted_data_file_is_noticed_by_the_next_write(tmp_path: Path) -> None:
    with open_store(tmp_path) as s:
        fill(s, range(4))
        (tmp_path / DATA_FILENAME).unlink()
        fill(s, [20])
        assert len(s) == 1 and s.stats.missing == 4
        assert s.get(key(20)) == block(20)


def test_index_rows_are_committed_only_after_their_data_is_written(tmp_path: Path) -> None:
    with RowCheckingStore(tmp_path, 8, BLOCK_BYTES, fsync=False) as s:
        assert s.put_many([(key(i), block(i)) for i in range(3)]).result() == [True] * 3
        assert s.early_rows == 0
    with open_store(tmp_path, num_slots=8) as s:
        assert len(s) == 3


def test_a_failed_write_commits_no_row(tmp_path: Path) -> None:
    with FailingStore(tmp_path, 4, BLOCK_BYTES, fsync=False) as s:
        assert s.put(key(1), block(1)).result() is False
        assert not s.contains(key(1)) and s.stats.write_errors == 1
        s.check_invariants()
    with open_store(tmp_path, num_slots=4) as s:
        assert len(s) == 0


# -- restart ------------------------------------------------------------------------------------


def test_reopening_the_directory_finds_and_verifies_the_blocks(tmp_path: Path) -> None:
    with open_store(tmp_path) as s:
        fill(s, range(20))
    with open_store(tmp_path, create=False) as s:
        assert len(s) == 20
        assert s.get_many([key(i) for i in range(20)]) == [block(i) for i in range(20)]


_CHILD = """
import sys, time
from hashlib import shake_256
from kvpilot.memory.hashing import chain_hashes
from kvpilot.store import DiskBlockStore
s = DiskBlockStore(sys.argv[1], 64, 4096)
keys = chain_hashes(list(range(40 * 16)), 16, salt="tenant-a")
assert all(s.put_many([(k, shake_256(k).digest(4096)) for k in keys]).result())
s.flush()
print("READY", flush=True)  # the parent SIGKILLs it here: no close()
while True:
    time.sleep(60)
"""


def test_blocks_flushed_by_a_killed_process_survive_reopen(tmp_path: Path) -> None:
    sigkill_when_ready(["-c", _CHILD, str(tmp_path)])
    keys = chain_hashes(list(range(40 * 16)), 16, salt="tenant-a")
    with open_store(tmp_path) as s:
        assert len(s) == 40
        assert s.get_many(keys) == [shake_256(k).digest(4096) for k in keys]
        assert s.stats.corrupt == 0 and s.stats.missing == 0


def test_lru_order_survives_restart(tmp_path: Path) -> None:
    clock = itertools.count().__next__
    with DiskBlockStore(tmp_path, 3, BLOCK_BYTES, fsync=False, clock=clock) as s:
        fill(s, [0])
        fill(s, [1])
        fill(s, [2])
        s.get(key(0))
    with DiskBlockStore(tmp_path, 3, BLOCK_BYTES, fsync=False, clock=clock) as s:
        fill(s, [3])
        assert [s.contains(key(i)) for i in range(4)] == [True, False, True, True]


def test_reopening_with_another_geometry_is_a_config_error(tmp_path: Path) -> None:
    with open_store(tmp_path, num_slots=8):
        pass
    with pytest.raises(ConfigError, match="block_bytes=4096"):
        DiskBlockStore(tmp_path, 8, 2048)
    with pytest.raises(ConfigError, match="num_slots=8"):
        DiskBlockStore(tmp_path, 16, BLOCK_BYTES)
    with open_store(tmp_path, num_slots=8) as s:
        assert len(s) == 0


def test_opening_a_missing_store_without_create_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="create=True"):
        DiskBlockStore(tmp_path / "nowhere", 8, BLOCK_BYTES, create=False)
    with pytest.raises(ConfigError, match="create=True"):
        DiskBlockStore(tmp_path, 8, BLOCK_BYTES, create=False)


def test_a_directory_is_open_in_one_store_at_a_time(tmp_path: Path) -> None:
    with open_store(tmp_path), pytest.raises(ConfigError, match="already open"):
        open_store(tmp_path)
    with open_store(tmp_path):
        pass


# -- eviction and duplicates --------------------------------------------------------------------


def test_a_full_store_evicts_the_least_recently_used_block(tmp_path: Path) -> None:
    with open_store(tmp_path, num_slots=3) as s:
        for i in range(3):
            fill(s, [i])
        assert s.get(key(0)) == block(0)
        fill(s, [3])
        assert [s.contains(key(i)) for i in range(4)] == [True, False, True, True]
        assert s.stats.evictions == 1
        assert s.get(key(3)) == block(3) and s.get(key(0)) == block(0)


def test_pinned_blocks_are_not_evicted_and_an_all_pinned_store_refuses(tmp_path: Path) -> None:
    with open_store(tmp_path, num_slots=2) as s:
        fill(s, [0, 1])
        assert s.pin(key(0)) and not s.pin(key(9))
        fill(s, [2])
        assert s.contains(key(0)) and not s.contains(key(1))
        assert s.pin(key(2))
        assert s.put(key(3), block(3)).result() is False
        s.unpin(key(2))
        assert s.put(key(3), block(3)).result() is True
        assert s.contains(key(0)) and not s.contains(key(2))
        s.check_invariants()


def test_a_batch_larger_than_the_store_keeps_its_newest_blocks(tmp_path: Path) -> None:
    with open_store(tmp_path, num_slots=4) as s:
        fill(s, range(6))
        assert sorted(i for i in range(6) if s.contains(key(i))) == [2, 3, 4, 5]
        assert s.get_many([key(i) for i in range(2, 6)]) == [block(i) for i in range(2, 6)]
        assert s.stats.evictions == 2
        s.check_invariants()


def test_a_duplicate_put_is_a_noop_returning_true(store: DiskBlockStore) -> None:
    fill(store, [1])
    before = store.stats
    assert store.put(key(1), block(2)).result() is True
    assert store.put_many([(key(5), block(5)), (key(5), block(6))]).result() == [True, True]
    assert store.get(key(1)) == block(1) and store.get(key(5)) == block(5)
    assert store.stats.blocks_written == before.blocks_written + 1


def test_delete_removes_a_block_durably(tmp_path: Path) -> None:
    with open_store(tmp_path) as s:
        fill(s, [1, 2])
        assert s.delete(key(1)) and not s.delete(key(1))
        assert s.get(key(1)) is None
        s.flush()
    with open_store(tmp_path) as s:
        assert not s.contains(key(1)) and s.contains(key(2))


def test_oversized_blocks_and_malformed_keys_are_rejected_at_put(store: DiskBlockStore) -> None:
    with pytest.raises(ConfigError, match="block_bytes"):
        store.put(key(1), b"x" * (BLOCK_BYTES + 1))
    with pytest.raises(InvalidRequest, match="16-byte"):
        store.put(b"short", b"x")
    with pytest.raises(InvalidRequest, match="16-byte"):
        store.get("not bytes")  # type: ignore[arg-type]
    assert len(store) == 0


# -- background writer --------------------------------------------------------------------------


def test_put_returns_before_the_write_reaches_disk(tmp_path: Path) -> None:
    s = GatedStore(tmp_path, 256, BLOCK_BYTES, fsync=False)
    s.gate = threading.Event()
    try:
        arr = np.frombuffer(block(0), dtype=np.uint8).copy()
        first = s.put(key(0), arr)
        batch = s.put_many([(key(i), block(i)) for i in range(1, 200)])
        arr[:] = 0  # the caller may reuse its buffer as soon as put returns
        assert not first.done() and not batch.done()
        assert s.stats.queued_writes == 200 and not s.contains(key(0))
        s.gate.set()
        s.flush()
        assert first.result() and batch.result() == [True] * 199
        assert s.get(key(0)) == block(0)
        assert s.stats.queued_writes == 0
    finally:
        s.gate.set()
        s.close()


def test_close_finishes_queued_puts_and_is_idempotent(tmp_path: Path) -> None:
    s = open_store(tmp_path)
    futures = [s.put(key(i), block(i)) for i in range(10)]
    s.close()
    s.close()
    assert all(f.result() for f in futures)
    with pytest.raises(KvpilotError, match="closed"):
        s.put(key(11), block(11))
    with open_store(tmp_path) as s2:
        assert len(s2) == 10


def test_puts_and_gets_from_many_threads_stay_consistent(tmp_path: Path) -> None:
    wrong: list[int] = []
    with open_store(tmp_path, num_slots=16) as s:

        def worker(base: int) -> None:
            for i in range(base, base + 40):
                s.put(key(i), block(i, 256))
                ids = range(base, i + 1)
                got = s.get_many([key(j) for j in ids])
                wrong.extend(
                    j for j, g in zip(ids, got, strict=True) if g not in (None, block(j, 256))
                )

        threads = [threading.Thread(target=worker, args=(b,)) for b in (0, 1000, 2000)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s.flush()
        assert wrong == []
        assert s.stats.corrupt == 0 and s.stats.missing == 0
        s.check_invariants()


# -- model check --------------------------------------------------------------------------------

_ops = st.lists(
    st.tuples(st.sampled_from(["put", "get", "delete", "pin", "unpin"]), st.integers(0, 7)),
    max_size=40,
)


@settings(max_examples=40, deadline=None)
@given(ops=_ops, num_slots=st.integers(1, 5))
def test_store_behaves_like_an_lru_map_with_pins(
    ops: list[tuple[str, int]], num_slots: int
) -> None:
    model: OrderedDict[int, bytes] = OrderedDict()
    pins: dict[int, int] = {}
    with tempfile.TemporaryDirectory() as d, open_store(Path(d), num_slots=num_slots) as s:
        for op, i in ops:
            if op == "put":
                data = block(i, 64)
                if i in model:
                    model.move_to_end(i)
                    expected = True
                elif len(model) < num_slots:
                    model[i], expected = data, True
                else:
                    victim = next((k for k in model if k not in pins), None)
                    expected = victim is not None
                    if victim is not None:
                        del model[victim]
                        model[i] = data
                assert s.put(key(i), data).result() is expected
            elif op == "get":
                assert s.get(key(i)) == model.get(i)
                if i in model:
                    model.move_to_end(i)
            elif op == "delete":
                assert s.delete(key(i)) is (model.pop(i, None) is not None)
                pins.pop(i, None)
            elif op == "pin":
                assert s.pin(key(i)) is (i in model)
                if i in model:
                    pins[i] = pins.get(i, 0) + 1
            else:
                s.unpin(key(i))
                if pins.get(i, 0) > 1:
                    pins[i] -= 1
                else:
                    pins.pop(i, None)
            s.check_invariants()
            assert {k for k in range(8) if s.contains(key(k))} == set(model)
        s.flush()
