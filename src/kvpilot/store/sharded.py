"""`ShardedDiskStore`: the disk tier under tensor parallelism, one shard store per rank.

A KV block of a ``degree``-way model is ``degree`` shards of equal size (rank r's KV heads,
in rank order). Each rank's shards live in a `DiskBlockStore` of their own, in
``directory/tp{degree}/rank{r}``, whose index records a fingerprint of (model, rank,
degree): a shard is keyed by (chained hash, rank, degree) under the model, and it carries
its own checksum, verified on every read. The engine sees one store of whole blocks:

- ``put_many`` splits each block and writes every shard to its rank's store (the shard
  stores' writer threads run side by side); a block counts as stored only when every
  shard is;
- ``get_many`` reads every rank's shards in parallel and returns a block only when every
  shard is present and verified (otherwise a miss), so a block is on disk only when every
  rank's shard is;
- the read bandwidth it reports is whole-block bytes over wall time: the aggregate over
  ranks, which the break-even rule needs next to the whole-block size.

A model loaded at another degree finds none of these shards (other folder, other
fingerprint); sessions (tokens only) are shared across degrees.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from hashlib import blake2b
from pathlib import Path

import numpy as np

from kvpilot.errors import ConfigError, InvalidRequest
from kvpilot.memory.hashing import HASH_BYTES, ModelFingerprint
from kvpilot.policy.meters import RateMeter
from kvpilot.store.disk import BlockData, DiskBlockStore
from kvpilot.store.stats import STORE_BW_ALPHA, DiskStoreStats


def shard_fingerprint(model: ModelFingerprint, rank: int, degree: int) -> ModelFingerprint:
    h = blake2b(model.digest, digest_size=HASH_BYTES, person=b"kvpilot-shard")
    h.update(f"{rank}/{degree}".encode())
    return ModelFingerprint(h.digest(), f"{model.label}, rank {rank} of {degree}")


def shard_directory(directory: Path, rank: int, degree: int) -> Path:
    return Path(directory) / f"tp{degree}" / f"rank{rank}"


class ShardedDiskStore:
    """Whole blocks of ``degree * shard_bytes`` bytes over one `DiskBlockStore` per rank;
    ``num_slots`` is each rank's store's (a whole block takes one slot in each)."""

    def __init__(
        self,
        directory: Path | str,
        num_slots: int,
        shard_bytes: int,
        degree: int,
        *,
        model: ModelFingerprint,
        fsync: bool = True,
    ) -> None:
        if degree < 2:
            raise ConfigError(f"a sharded store needs a degree >= 2, got {degree}")
        self.degree = degree
        self.shard_bytes = shard_bytes
        self.block_bytes = shard_bytes * degree
        self.num_slots = num_slots
        self.shards: list[DiskBlockStore] = []
        try:
            for rank in range(degree):
                self.shards.append(
                    DiskBlockStore(
                        shard_directory(Path(directory), rank, degree),
                        num_slots,
                        shard_bytes,
                        fsync=fsync,
                        model=shard_fingerprint(model, rank, degree),
                    )
                )
        except BaseException:
            for store in self.shards:
                store.close()
            raise
        self._readers = ThreadPoolExecutor(degree, thread_name_prefix="kvpilot-shard-read")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvpilot-sharded-get")
        self._read_bw = RateMeter(alpha=STORE_BW_ALPHA)

    # -- writes ----------------------------------------------------------------------------

    def _split(self, data: BlockData) -> list[bytes]:
        raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
        if len(raw) != self.block_bytes:
            raise InvalidRequest(
                f"a {len(raw)}-byte block is not {self.degree} shards of {self.shard_bytes} bytes"
            )
        s = self.shard_bytes
        return [raw[r * s : (r + 1) * s] for r in range(self.degree)]

    def put(self, key: bytes, data: BlockData) -> Future[bool]:
        done: Future[bool] = Future()
        many = self.put_many([(key, data)])
        many.add_done_callback(lambda f: done.set_result(f.result()[0]))
        return done

    def put_many(self, items: Iterable[tuple[bytes, BlockData]]) -> Future[list[bool]]:
        """Every shard of every block to its rank's store; True where every shard was stored."""
        pairs = [(key, self._split(data)) for key, data in items]
        futures = [
            store.put_many([(key, parts[rank]) for key, parts in pairs])
            for rank, store in enumerate(self.shards)
        ]
        done: Future[list[bool]] = Future()
        remaining = [len(futures)]

        def settle(_: Future[list[bool]]) -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                try:
                    per_rank = [f.result() for f in futures]
                    done.set_result([all(oks) for oks in zip(*per_rank, strict=True)])
                except BaseException as exc:  # handed to the waiter
                    done.set_exception(exc)

        for f in futures:
            f.add_done_callback(settle)
        return done

    def flush(self) -> None:
        for store in self.shards:
            store.flush()

    # -- reads -----------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Whole blocks where every rank's shard is present and verified, else None."""
        keys = list(keys)
        start = time.perf_counter()
        reads = [self._readers.submit(store.get_many, keys) for store in self.shards]
        per_rank = [r.result() for r in reads]
        out: list[bytes | None] = []
        for parts in zip(*per_rank, strict=True):
            present = [p for p in parts if p is not None]
            out.append(b"".join(present) if len(present) == self.degree else None)
        got = sum(len(b) for b in out if b is not None)
        if got:
            self._read_bw.observe(got, time.perf_counter() - start)
        return out

    def get_async(self, keys: Sequence[bytes]) -> Future[list[bytes | None]]:
        return self._reader.submit(self.get_many, list(keys))

    # -- index -----------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return all(store.contains(key) for store in self.shards)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.contains(key)

    def __len__(self) -> int:
        """Blocks whose every shard is stored (at most any one rank's count)."""
        return min(len(store) for store in self.shards)

    def delete(self, key: bytes) -> bool:
        deleted = [store.delete(key) for store in self.shards]
        return any(deleted)

    def pin(self, key: bytes) -> bool:
        pinned: list[DiskBlockStore] = []
        for store in self.shards:
            if not store.pin(key):
                for other in pinned:
                    other.unpin(key)
                return False
            pinned.append(store)
        return True

    def unpin(self, key: bytes) -> None:
        for store in self.shards:
            store.unpin(key)

    @property
    def stats(self) -> DiskStoreStats:
        """Whole-block figures: events as the worst rank saw them, bytes summed over ranks,
        bandwidths aggregated over ranks."""
        each = [store.stats for store in self.shards]
        worst = {
            name: max(getattr(s, name) for s in each)
            for name in (
                "queued_writes",
                "blocks_written",
                "blocks_read",
                "misses",
                "corrupt",
                "missing",
                "evictions",
                "write_errors",
            )
        }
        return DiskStoreStats(
            blocks_stored=len(self),
            num_slots=self.num_slots,
            bytes_written=sum(s.bytes_written for s in each),
            bytes_read=sum(s.bytes_read for s in each),
            hits=min(s.hits for s in each),
            read_bw_bytes_s=self._read_bw.get(0.0),
            write_bw_bytes_s=sum(s.write_bw_bytes_s for s in each),
            **worst,
        )

    def check_invariants(self) -> None:
        for store in self.shards:
            store.check_invariants()

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        for store in self.shards:
            store.close()

    def __enter__(self) -> ShardedDiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
