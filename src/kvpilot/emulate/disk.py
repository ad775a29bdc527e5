"""`ThrottledDiskStore`: the disk block store with reads and writes at an emulated bandwidth.

Reads and writes are real (`kvpilot.store.DiskBlockStore` does them) and finish no earlier
than their slot on an emulated disk link (`kvpilot.emulate.link`): one queue for reads, one
for writes. ``stats`` reports the bandwidths measured that way, which is what the pause rule
reads as the disk's speed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvpilot.emulate.link import LinkSchedule, ThrottledTransfer
from kvpilot.policy.meters import RateMeter

if TYPE_CHECKING:
    from kvpilot.store import DiskBlockStore
    from kvpilot.store.stats import DiskStoreStats


class ThrottledDiskStore:
    """Wraps a `DiskBlockStore`; what is not a read or a write passes through."""

    def __init__(self, inner: DiskBlockStore, link: LinkSchedule) -> None:
        self.inner = inner
        self.link = link
        self.block_bytes = inner.block_bytes
        self.read_bw = RateMeter(alpha=0.25)
        self.write_bw = RateMeter(alpha=0.25)

    def _observer(self, meter: RateMeter, nbytes: int) -> Any:
        return lambda seconds: meter.observe(nbytes, seconds)

    def put_many(self, items: Iterable[tuple[bytes, Any]]) -> ThrottledTransfer:
        items = list(items)
        nbytes = len(items) * self.block_bytes
        start, finish = self.link.reserve("write", nbytes)
        return ThrottledTransfer(
            self.inner.put_many(items),
            start,
            finish,
            self.link.clock,
            timed=False,
            on_settle=self._observer(self.write_bw, nbytes),
            sleep=self.link.sleep,
            real_time_counts=self.link.real_time_counts,
        )

    def get_async(self, keys: Sequence[bytes]) -> ThrottledTransfer:
        nbytes = len(keys) * self.block_bytes
        start, finish = self.link.reserve("read", nbytes)
        return ThrottledTransfer(
            self.inner.get_async(keys),
            start,
            finish,
            self.link.clock,
            timed=False,
            on_settle=self._observer(self.read_bw, nbytes),
            sleep=self.link.sleep,
            real_time_counts=self.link.real_time_counts,
        )

    def get_many(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        start, finish = self.link.reserve("read", len(keys) * self.block_bytes)
        out = self.inner.get_many(keys)
        delay = finish - self.link.clock()
        if delay > 0:
            self.link.sleep(delay)
        self.read_bw.observe(len(keys) * self.block_bytes, max(finish, self.link.clock()) - start)
        return out

    def get(self, key: bytes) -> memoryview | None:
        return self.get_many([key])[0]

    @property
    def stats(self) -> DiskStoreStats:
        inner = self.inner.stats
        return dataclasses.replace(
            inner,
            read_bw_bytes_s=self.read_bw.get(inner.read_bw_bytes_s),
            write_bw_bytes_s=self.write_bw.get(inner.write_bw_bytes_s),
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)
