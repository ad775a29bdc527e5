"""`ThrottledTransport`: a tier transport whose device<->host copies run at an emulated
link's bandwidth (see `kvpilot.emulate.link`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpilot.emulate.link import LinkSchedule, ThrottledTransfer

if TYPE_CHECKING:
    from kvpilot.engine.executor import TierTransport, Transfer


class ThrottledTransport:
    """A `TierTransport` whose device<->host copies run at ``link.bytes_per_s``.

    Disk traffic crosses the same link (read_device before a disk write, write_device after
    a disk read), as it would through host memory on an accelerator node.
    """

    def __init__(self, inner: TierTransport, link: LinkSchedule) -> None:
        self.inner = inner
        self.link = link
        self.num_host_blocks = inner.num_host_blocks
        self.block_bytes = inner.block_bytes

    def _wrap(self, direction: str, blocks: int, transfer: Transfer, *, timed: bool) -> Transfer:
        start, finish = self.link.reserve(direction, blocks * self.block_bytes)
        return ThrottledTransfer(
            transfer,
            start,
            finish,
            self.link.clock,
            timed=timed,
            sleep=self.link.sleep,
            real_time_counts=self.link.real_time_counts,
        )

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> Transfer:
        return self._wrap("out", len(pairs), self.inner.swap_out(pairs), timed=True)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> Transfer:
        return self._wrap("in", len(pairs), self.inner.swap_in(pairs), timed=True)

    def read_device(self, blocks: Sequence[int]) -> Transfer:
        return self._wrap("out", len(blocks), self.inner.read_device(blocks), timed=False)

    def write_device(self, blocks: Sequence[int], data: Sequence[bytes]) -> Transfer:
        return self._wrap("in", len(blocks), self.inner.write_device(blocks, data), timed=True)

    def poison_host(self, blocks: Sequence[int]) -> None:
        self.inner.poison_host(blocks)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
