"""`ShardedDiskStore`: a block is stored and read back only as every rank's verified shard."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.errors import InvalidRequest
from kvpilot.memory.hashing import ModelFingerprint
from kvpilot.store.sharded import ShardedDiskStore, shard_directory, shard_fingerprint

SHARD = 512
MODEL = ModelFingerprint.of("test model")


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int, degree: int = 2) -> bytes:
    """Every shard differs (so a swapped or misplaced shard shows)."""
    return b"".join(
        bytes([(i * 7 + r * 31 + j) % 251 for j in range(SHARD)]) for r in range(degree)
    )


def open_store(path: Path, degree: int = 2, model: ModelFingerprint = MODEL) -> ShardedDiskStore:
    return ShardedDiskStore(path, 16, SHARD, degree, model=model, fsync=False)


def test_blocks_round_trip_as_their_shards_in_rank_order(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        assert store.put_many([(key(i), block(i)) for i in range(4)]).result() == [True] * 4
        assert store.get_many([key(i) for i in range(4)]) == [block(i) for i in range(4)]
        assert store.contains(key(2)) and len(store) == 4
        stats = store.stats
        assert (stats.hits, stats.blocks_stored, stats.bytes_read) == (4, 4, 8 * SHARD)
        assert stats.read_bw_bytes_s > 0
        for rank in range(2):  # each rank's shard store holds exactly its shard
            shard = store.shards[rank].get(key(1))
            assert shard == block(1)[rank * SHARD : (rank + 1) * SHARD]
        store.check_invariants()


def test_a_block_missing_or_corrupt_on_one_rank_is_a_miss(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.put_many([(key(i), block(i)) for i in range(3)]).result()
        store.shards[1].delete(key(0))
        data = shard_directory(tmp_path, 0, 2) / "blocks.dat"
        raw = bytearray(data.read_bytes())
        at = raw.find(block(2)[:SHARD])  # flip a byte of rank 0's shard of block 2
        assert at >= 0
        raw[at + 5] ^= 0x01
        data.write_bytes(bytes(raw))
        assert store.get_many([key(0), key(1), key(2)]) == [None, block(1), None]
        assert not store.contains(key(0))
        assert store.stats.corrupt == 1
        store.check_invariants()


def test_shards_are_keyed_by_rank_and_degree_under_the_model(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.put(key(0), block(0)).result()
    fingerprints = {shard_fingerprint(MODEL, r, d).digest for d in (2, 4) for r in range(d)}
    assert len(fingerprints) == 6
    with open_store(tmp_path, degree=4) as other_degree:  # another folder, nothing shared
        assert other_degree.get(key(0)) is None
    with open_store(tmp_path) as again:  # a restart at the same degree finds every shard
        assert again.get(key(0)) == block(0)
    with open_store(tmp_path, model=ModelFingerprint.of("another model")) as other_model:
        assert other_model.get(key(0)) is None  # (and its shards are dropped, as unsharded)


def test_a_block_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    with open_store(tmp_path) as store, pytest.raises(InvalidRequest, match="2 shards"):
        store.put(key(0), b"x" * (SHARD + 1))
