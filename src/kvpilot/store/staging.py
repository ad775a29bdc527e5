"""The disk writer's staging: two page-aligned buffers that take turns, and an I/O thread.

A batch of blocks goes to disk a buffer at a time: the writer thread copies blocks into one
buffer (whole slots, so direct I/O can take them) and checksums them there, while the I/O
thread writes the other (the first shares are small, so the disk starts early). The buffers
are mapped (and their pages faulted in) once, when the store opens, and reused for its
lifetime: fresh pages would cost a page fault each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from kvpilot.store.buffers import aligned_buffer

Writes = list[tuple[int, memoryview]]


class StagedWrites:
    def __init__(self, block_bytes: int, chunk_blocks: int) -> None:
        self.block_bytes = block_bytes
        self.chunk = chunk_blocks
        self._buffers = [aligned_buffer(chunk_blocks * block_bytes, populate=True) for _ in "ab"]
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpilot-disk-io")

    def write(
        self,
        blocks: Sequence[tuple[int, bytes]],
        write_slots: Callable[[Writes], None],
        digest: Callable[[memoryview], bytes],
    ) -> list[bytes]:
        """Writes each ``(slot, data)`` (in slot order, for runs of consecutive slots) with
        ``write_slots`` on the I/O thread, a buffer at a time; returns each block's ``digest``
        of the bytes staged for it. Returns or raises only when no write is in flight."""
        b = self.block_bytes
        sums: list[bytes] = []
        writing: list[Future[None]] = []
        try:
            for n, (first, end) in enumerate(self.chunks(len(blocks))):
                if len(writing) >= 2:
                    writing[-2].result()  # its buffer is the one to fill now
                staging = self._buffers[n % 2]
                writes: Writes = []
                for j, (slot, data) in enumerate(blocks[first:end]):
                    staging[j * b : j * b + len(data)] = data
                    sums.append(digest(staging[j * b : j * b + len(data)]))
                    writes.append((slot, staging[j * b : (j + 1) * b]))
                writing.append(self._io.submit(write_slots, writes))
        finally:
            wait(writing)  # no write may still read a buffer when this returns
        for done in writing:
            done.result()
        return sums

    def chunks(self, count: int) -> list[tuple[int, int]]:
        """[first, end) of each buffer's share of ``count`` blocks: an eighth of a buffer
        first, then doubling up to a whole one, so the disk starts after a short copy and
        each copy is shorter than the write it overlaps."""
        out: list[tuple[int, int]] = []
        size = max(1, self.chunk // 8)
        first = 0
        while first < count:
            out.append((first, min(count, first + size)))
            first, size = first + size, min(self.chunk, 2 * size)
        return out

    def close(self) -> None:
        self._io.shutdown(wait=True)
