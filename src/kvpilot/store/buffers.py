"""Page-aligned buffers for the disk store's direct I/O, and a pool that reuses them.

Fresh anonymous memory is costly here: every page faults and is zeroed the first time it is
touched, about 1-2 GB/s of CPU, the same order as the disk itself. So the store keeps its
buffers mapped and reuses them: the writer's staging buffers for its lifetime, and the
buffers ``get_many`` reads into once every view handed out of one is gone (the store maps two
of them when it opens, so its first reads do not pay the faults either: a read into fresh
pages took 2-3x as long as one into mapped pages here).
"""

from __future__ import annotations

import mmap
import sys
import threading

import numpy as np

ALIGN = 4096  # O_DIRECT offsets, lengths and buffer addresses are multiples of this


def aligned_buffer(nbytes: int, *, populate: bool = False) -> memoryview:
    """A writable, zero-filled, page-aligned buffer of ``nbytes`` (anonymous memory);
    ``populate`` maps its pages now (one bulk fault instead of one per page later)."""
    return memoryview(_map(nbytes, populate=populate))[:nbytes]


def _map(nbytes: int, *, populate: bool = False) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, max(nbytes, 1), flags=flags)


def is_aligned(buf: memoryview) -> bool:
    return buf.nbytes == 0 or np.frombuffer(buf, np.uint8).ctypes.data % ALIGN == 0


class ReadBuffers:
    """Buffers for reads whose blocks are handed out as views: a buffer is reused once no
    view of it is left (its reference count is back to the pool's own), so a loader that
    drops each read's blocks after copying them reads into memory already mapped.

    At most ``slots`` buffers of ``max_bytes`` in all are kept; a read that finds none free
    gets a new buffer, kept if there is room (made by letting the smallest idle one go).
    Thread-safe.
    """

    def __init__(self, *, slots: int = 4, max_bytes: int = 64 << 20) -> None:
        self.slots = slots
        self.max_bytes = max_bytes
        self._kept: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.reused = 0  # reads that found a free buffer
        self.mapped = 0  # reads that mapped a new one

    def take(self, nbytes: int) -> memoryview:
        """A page-aligned writable view of at least ``nbytes``, no other view of which exists."""
        with self._lock:
            free = [i for i in self._idle() if len(self._kept[i]) >= nbytes]
            if free:
                self.reused += 1
                return memoryview(self._kept[min(free, key=lambda i: len(self._kept[i]))])[:nbytes]
            self.mapped += 1
            m = _map(nbytes)
            idle = sorted((self._kept[i] for i in self._idle()), key=len)
            while idle and not self._fits(len(m)):
                self._kept.remove(idle.pop(0))  # the smallest idle buffer makes room
            if self._fits(len(m)):
                self._kept.append(m)
            return memoryview(m)[:nbytes]

    def prefill(self, nbytes: int, count: int) -> None:
        """Maps ``count`` buffers of ``nbytes`` now, their pages faulted in (as far as the
        budget allows): the first reads land in memory already mapped, as later ones do."""
        with self._lock:
            for _ in range(count):
                if not self._fits(nbytes):
                    return
                self._kept.append(_map(nbytes, populate=True))

    def _fits(self, nbytes: int) -> bool:
        kept = sum(len(k) for k in self._kept)
        return len(self._kept) < self.slots and kept + nbytes <= self.max_bytes

    def _idle(self) -> list[int]:
        """Positions of the kept buffers no view of which is left: referenced by the list and
        getrefcount's argument only (each view holds one more, through its buffer)."""
        return [i for i in range(len(self._kept)) if sys.getrefcount(self._kept[i]) <= 2]
