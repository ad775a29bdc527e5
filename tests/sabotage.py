"""Deliberate bugs, one at a time, to prove the equivalence checks can fail.

Each context manager patches one thing the KV path relies on, the way a plausible bug would
break it; tests/test_sabotage.py runs the relevant scenario of tests/equivalence.py under it
and expects `EquivalenceMismatch`. Everything is restored on exit.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import numpy as np
import torch

import kvpilot.store.disk
from kvpilot.memory.radix import RadixCache
from kvpilot.model.batch import StepBatch
from kvpilot.model.runner import ModelRunner
from kvpilot.model.transfer import TorchTierTransport
from kvpilot.store.disk import DiskBlockStore


@contextmanager
def patched(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    saved = owner.__dict__[name] if name in getattr(owner, "__dict__", {}) else getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def swap_in_skipped() -> AbstractContextManager[None]:
    """The host -> device copy never happens: the device blocks keep whatever they held."""

    def swap_in(self: TorchTierTransport, pairs: Sequence[tuple[int, int]]) -> Future[float]:
        done: Future[float] = Future()
        done.set_result(1e-6)
        return done

    return patched(TorchTierTransport, "swap_in", swap_in)


def swap_out_skipped() -> AbstractContextManager[None]:
    """The device -> host copy never happens: the host blocks keep whatever they held."""

    def swap_out(self: TorchTierTransport, pairs: Sequence[tuple[int, int]]) -> Future[float]:
        done: Future[float] = Future()
        done.set_result(1e-6)
        return done

    return patched(TorchTierTransport, "swap_out", swap_out)


def disk_read_returns_another_block() -> AbstractContextManager[None]:
    """A verified disk read hands each block the bytes of the next one it was asked for (the
    last one keeps its own).

    Not a rotation: attention sums over the cached (key, value) pairs, each key carrying its
    own position, so a permutation of whole blocks inside a fully visible prefix leaves
    every output as it was. A wrong block has to replace another's KV to matter.
    """
    get_many = DiskBlockStore.get_many

    def shifted(self: DiskBlockStore, keys: Sequence[bytes]) -> list[bytes | None]:
        out = get_many(self, keys)
        found = [i for i, data in enumerate(out) if data is not None]
        shifted_out = list(out)
        for i, j in itertools.pairwise(found):
            shifted_out[i] = out[j]
        return shifted_out

    return patched(DiskBlockStore, "get_many", shifted)


def slot_mapping_off_by_one() -> AbstractContextManager[None]:
    """Decode tokens write their K/V one slot past where they belong (reads go through the
    block table, so they find the wrong slot)."""
    build = StepBatch.build.__func__  # type: ignore[attr-defined]

    def shifted(cls: type[StepBatch], works: Any, **kw: Any) -> StepBatch:
        batch: StepBatch = build(cls, works, **kw)
        if not batch.num_decodes:
            return batch
        shift = torch.zeros_like(batch.slot_mapping)
        index = batch.decode_token_index
        if index is None:
            shift += 1
        else:
            shift[index] = 1
        slots = (batch.slot_mapping + shift) % (kw["num_blocks"] * kw["block_size"])
        return dataclasses.replace(batch, slot_mapping=slots)

    return patched(StepBatch, "build", classmethod(shifted))


def copy_on_write_skipped() -> AbstractContextManager[None]:
    """A fork's partial tail block is never copied into the child's new block."""

    def copy_blocks(self: ModelRunner, pairs: Sequence[tuple[int, int]]) -> None:
        del pairs

    return patched(ModelRunner, "copy_blocks", copy_blocks)


def checksums_disabled() -> AbstractContextManager[None]:
    """The disk tier's checksum accepts anything (every block hashes alike)."""

    def checksum(data: bytes | memoryview) -> bytes:
        return bytes(16)

    return patched(kvpilot.store.disk, "checksum", checksum)


def prefix_match_one_block_long() -> AbstractContextManager[None]:
    """Where a query leaves a cached edge, the match claims the block it diverges in too."""

    def common_blocks(self: RadixCache, edge: Any, query: bytes, offset: int, end: int) -> int:
        n = min(len(edge), (end - offset) // 4)
        a = np.frombuffer(edge, dtype=np.int32, count=n)
        b = np.frombuffer(query, dtype=np.int32, count=n, offset=offset)
        diff = np.flatnonzero(a != b)
        if not diff.size:
            return n // self.block_size
        return min(int(diff[0]) // self.block_size + 1, n // self.block_size)

    return patched(RadixCache, "_common_blocks", common_blocks)


SABOTAGES: dict[str, Callable[[], AbstractContextManager[None]]] = {
    "swap_in_skipped": swap_in_skipped,
    "preempted_swap_in_skipped": swap_in_skipped,
    "preempted_swap_out_skipped": swap_out_skipped,
    "disk_read_returns_another_block": disk_read_returns_another_block,
    "slot_mapping_off_by_one": slot_mapping_off_by_one,
    "copy_on_write_skipped": copy_on_write_skipped,
    "checksums_disabled": checksums_disabled,
    "prefix_match_one_block_long": prefix_match_one_block_long,
}
