"""`TensorParallelTransport`: tier moves of a block as every rank's move of its own shard.

Implements `kvpilot.engine.executor.TierTransport` for a `TensorParallelExecutor`. Every rank
has its own host pool (same host block ids on every rank, like the device pool); a move is a
command all ranks run on their own shard (device <-> host with the plain
`TorchTierTransport`), and it completes only when every rank's part has: a block is resident
in a tier only when every rank's shard is. For the disk tier, ``read_device`` gathers the
ranks' shard bytes on rank 0 (a block's bytes are its shards in rank order, which
`ShardedDiskStore` splits again into per-rank, per-shard checksummed entries) and
``write_device`` sends each rank its own shard.

``block_bytes`` is the whole block (every rank's shard); the seconds each move reports are
the wall time of all ranks moving in parallel, so bytes over seconds is the node's aggregate
link bandwidth and the break-even rule sees per-rank bytes over per-rank bandwidth.
Moves run synchronously on the caller (the step loop): the returned `Transfer` is done.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvpilot.errors import TensorParallelError
from kvpilot.memory.hashing import ModelFingerprint
from kvpilot.model.parallel.executor import TensorParallelExecutor
from kvpilot.store.sharded import ShardedDiskStore


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class TensorParallelTransport:
    def __init__(self, executor: TensorParallelExecutor, num_host_blocks: int) -> None:
        self.executor = executor
        self.num_host_blocks = num_host_blocks
        self.degree = executor.degree
        self.shard_bytes = executor.shard_block_bytes
        self.block_bytes = self.shard_bytes * self.degree
        executor.command("open_tiers", num_host_blocks)
        self._closed = False

    def _timed(self, op: str, payload: Any) -> Future[float]:
        start = time.perf_counter()
        self.executor.command(op, payload)
        return _done(time.perf_counter() - start)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> Future[float]:
        return self._timed("swap_out", [(int(d), int(h)) for d, h in pairs])

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> Future[float]:
        return self._timed("swap_in", [(int(h), int(d)) for h, d in pairs])

    def read_device(self, blocks: Sequence[int]) -> Future[list[bytes]]:
        per_rank = self.executor.command("read_device", [int(b) for b in blocks])
        return _done([b"".join(shards) for shards in zip(*per_rank, strict=True)])

    def write_device(self, blocks: Sequence[int], data: Sequence[bytes]) -> Future[float]:
        s = self.shard_bytes
        shards = [[bytes(d[r * s : (r + 1) * s]) for d in data] for r in range(self.degree)]
        return self._timed("write_device", ([int(b) for b in blocks], shards))

    def open_disk_store(
        self, directory: Path, num_slots: int, model: ModelFingerprint
    ) -> ShardedDiskStore:
        """The disk tier for this degree: one shard store per rank (`ShardedDiskStore`)."""
        return ShardedDiskStore(directory, num_slots, self.shard_bytes, self.degree, model=model)

    def poison_host(self, blocks: Sequence[int]) -> None:
        if blocks:
            self.executor.command("poison_host", [int(b) for b in blocks], local_first=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(TensorParallelError):  # workers gone: rank 0's part below
            self.executor.command("close_tiers", None)
        if self.executor.shard.transport is not None:
            self.executor.shard.transport.close()
