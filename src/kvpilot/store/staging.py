"""The disk writer's staging: page-aligned buffers that take turns, and an I/O thread.

Blocks go to disk a buffer at a time: the writer thread copies blocks into one buffer (whole
slots, so direct I/O can take them) and checksums each right after its copy (still in cache),
both without holding the GIL, while the I/O thread writes the buffers filled before. ``write``
returns once a batch is staged, not written: the writer stages the next batch while this
one's last buffers go to disk, so the disk does not wait for a batch's fsync and index commit
(the store's sync thread, `kvpilot.store.durable`) before it gets more bytes. Only when the
I/O thread is idle does a batch start with a small share (the disk starts after a short
copy); behind a busy one every share is a whole buffer.

The buffers are mapped (and their pages faulted in) once, when the store opens, and reused
for its lifetime: fresh pages would cost a page fault each.

Writes complete in submission order (one I/O thread), so ``completed`` (how many shares are
written, failed ones too) tells the fsync which batches it covers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from kvpilot.store.buffers import aligned_buffer

Writes = list[tuple[int, memoryview]]

BUFFERS = 2  # the writer fills one while the I/O thread writes the other


class StagedWrites:
    def __init__(self, block_bytes: int, chunk_blocks: int, buffers: int = BUFFERS) -> None:
        self.block_bytes = block_bytes
        self.chunk = chunk_blocks
        self._buffers = [
            aligned_buffer(chunk_blocks * block_bytes, populate=True) for _ in range(buffers)
        ]
        self._arrays = [np.frombuffer(buf, np.uint8) for buf in self._buffers]
        self._last: list[Future[None] | None] = [None] * buffers  # each buffer's last write
        self._next = 0  # the buffer to fill next
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpilot-disk-io")
        self._count_lock = threading.Lock()
        self.submitted = 0  # shares handed to the I/O thread
        self.completed = 0  # shares written (or failed), in submission order

    def write(
        self,
        blocks: Sequence[tuple[int, bytes]],
        write_slots: Callable[[Writes], None],
        digest: Callable[[memoryview], bytes],
    ) -> tuple[list[bytes], Future[int]]:
        """Stages each ``(slot, data)`` (in slot order, for runs of consecutive slots) and hands
        it to ``write_slots`` on the I/O thread, a buffer at a time; returns each block's
        ``digest`` of the bytes staged for it, and a future that resolves once every share of
        this batch is written, with ``submitted`` after its last share (or with the first
        share's error, once none of them is in flight). Called from one thread only."""
        b = self.block_bytes
        sums: list[bytes] = []
        shares: list[Future[None]] = []
        for first, end in self.chunks(len(blocks), ramp=self.idle()):
            n = self._next
            self._next = (n + 1) % len(self._buffers)
            last = self._last[n]
            if last is not None:
                wait([last])  # the buffer to fill is free once its write is done
            staging, into = self._buffers[n], self._arrays[n]
            writes: Writes = []
            for j, (slot, data) in enumerate(blocks[first:end]):
                # numpy copies without the GIL (a memoryview assignment holds it, and the
                # I/O thread would wait up to the switch interval to return from each write).
                np.copyto(into[j * b : j * b + len(data)], np.frombuffer(data, np.uint8))
                sums.append(digest(staging[j * b : j * b + len(data)]))
                writes.append((slot, staging[j * b : (j + 1) * b]))
            share = self._io.submit(self._write_share, write_slots, writes)
            self._last[n] = share
            shares.append(share)
            self.submitted += 1
        done: Future[int] = Future()
        seq = self.submitted
        if not shares:
            done.set_result(seq)
            return sums, done
        pending = [len(shares)]
        lock = threading.Lock()

        def finished(_: Future[None]) -> None:
            with lock:
                pending[0] -= 1
                if pending[0]:
                    return
            error = next((s.exception() for s in shares if s.exception() is not None), None)
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(seq)

        for share in shares:
            share.add_done_callback(finished)
        return sums, done

    def _write_share(self, write_slots: Callable[[Writes], None], writes: Writes) -> None:
        try:
            write_slots(writes)
        finally:
            with self._count_lock:
                self.completed += 1

    def idle(self) -> bool:
        """No share is queued or being written."""
        with self._count_lock:
            return self.completed == self.submitted

    def chunks(self, count: int, *, ramp: bool = True) -> list[tuple[int, int]]:
        """[first, end) of each buffer's share of ``count`` blocks: whole buffers, except
        that with ``ramp`` (the disk is idle) the first share is an eighth of a buffer and
        each next one doubles, so the disk starts after a short copy and each copy is
        shorter than the write it overlaps."""
        out: list[tuple[int, int]] = []
        size = max(1, self.chunk // 8) if ramp else self.chunk
        first = 0
        while first < count:
            out.append((first, min(count, first + size)))
            first, size = first + size, min(self.chunk, 2 * size)
        return out

    def close(self) -> None:
        """Waits for every write in flight, then stops the I/O thread."""
        self._io.shutdown(wait=True)
