"""The disk tier's data file: ``num_slots`` fixed-size slots, and the directory lock.

Slot ``s`` holds a block's bytes at ``[s * block_bytes, s * block_bytes + length)``. The file
is opened per batch rather than held open, so a file deleted or replaced behind the store's back
is noticed (a held descriptor would keep reading the unlinked inode).

I/O goes in runs: consecutive slots are one ``pwrite``/``preadv`` of a contiguous buffer, so an
offload of a long prefix (which takes consecutive free slots) is one large sequential extent.
Where the slot size is a multiple of `ALIGN` and the file system accepts it, the file is opened
with ``O_DIRECT``: the bytes go between the caller's page-aligned buffer and the device without
the page cache (no kernel copy, no write-back at fsync, no cache filled with KV the host tier
should have had). Whole slots move then, so a short block's slot tail holds whatever the
buffer had; reads check ``length`` bytes only. Elsewhere it is buffered I/O of the same runs.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import xxhash

from kvpilot.errors import ConfigError
from kvpilot.store.buffers import ALIGN, is_aligned

DATA_FILENAME = "blocks.dat"
LOCK_FILENAME = "LOCK"
CHECKSUM_BYTES = 16
IOV_MAX = 1024
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def checksum(data: bytes | memoryview) -> bytes:
    """XXH3-128 of ``data``: ~20 GB/s per core, so verifying costs little next to the disk; a
    damage check, not a defence against someone forging blocks in the store's own folder."""
    return xxhash.xxh3_128_digest(data)


def runs(
    pairs: Sequence[tuple[int, int]], whole: Sequence[bool] | None = None
) -> list[tuple[int, int, int]]:
    """(first position, first slot, count) of each run in ``pairs`` of (position, slot) where
    both go up by one from pair to pair; a pair whose ``whole`` is False ends its run."""
    out: list[tuple[int, int, int]] = []
    open_run = False
    for i, (pos, slot) in enumerate(pairs):
        last = out[-1] if out else None
        if open_run and last and last[0] + last[2] == pos and last[1] + last[2] == slot:
            out[-1] = (last[0], last[1], last[2] + 1)
        else:
            out.append((pos, slot, 1))
        open_run = whole is None or whole[i]
    return out


class SlotFile:
    def __init__(self, directory: Path, num_slots: int, block_bytes: int) -> None:
        self.path = directory / DATA_FILENAME
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.full_size = num_slots * block_bytes
        # Whether O_DIRECT is tried; cleared the first time the file system refuses it.
        self.direct = bool(_O_DIRECT) and block_bytes % ALIGN == 0

    def size(self) -> int | None:
        """Current file size, or None when the file is gone."""
        try:
            return os.stat(self.path).st_size
        except FileNotFoundError:
            return None

    def check_space(self) -> None:
        """ConfigError unless the file system can hold the file at full size: the file is
        sparse, so a tier larger than the free space would fail its writes later, not now."""
        try:
            used = os.stat(self.path).st_blocks * 512
        except FileNotFoundError:
            used = 0
        need = self.full_size - used
        free = shutil.disk_usage(self.path.parent).free
        if need > free:
            fit = (free + used) // self.block_bytes
            raise ConfigError(
                f"the disk tier in {self.path.parent} needs {self.full_size:,} bytes "
                f"({self.num_slots} blocks of {self.block_bytes:,} bytes) but only {free:,} "
                f"bytes are free there: lower --disk-blocks to at most {fit}, or free space"
            )

    def restore(self) -> None:
        """Creates the file, or extends it to full size (sparse: no space is reserved)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < self.full_size:
                os.ftruncate(fd, self.full_size)
        finally:
            os.close(fd)

    def _open(self, flags: int, *, direct: bool) -> tuple[int, bool]:
        """A descriptor, and whether it bypasses the page cache."""
        if direct and self.direct:
            try:
                return os.open(self.path, flags | _O_DIRECT), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # this file system does not do direct I/O
                    raise
                self.direct = False
        return os.open(self.path, flags), False

    def write(self, writes: Sequence[tuple[int, memoryview]], *, fsync: bool) -> None:
        """Writes each ``(slot, data)``: a run of consecutive slots is one ``pwritev``. With
        ``fsync`` the data is on stable storage on return. Direct I/O when every buffer is a
        whole, page-aligned slot (`DiskBlockStore` stages them so)."""
        b = self.block_bytes
        full = all(view.nbytes == b and is_aligned(view) for _, view in writes)
        fd, _ = self._open(os.O_WRONLY, direct=full)
        try:
            ordered = sorted(writes, key=lambda w: w[0])
            pairs = [(i, slot) for i, (slot, _) in enumerate(ordered)]
            for pos, slot, count in runs(pairs, [v.nbytes == b for _, v in ordered]):
                _pwritev(fd, [view for _, view in ordered[pos : pos + count]], slot * b)
            if fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def sync(self) -> None:
        """Everything written so far is on stable storage (data and the file's metadata)."""
        fd = os.open(self.path, os.O_WRONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def read(self, slots: Sequence[tuple[int, int]], out: memoryview) -> list[int] | None:
        """Reads the slot of each ``(position, slot)`` into ``out[position * block_bytes:]``
        (whole slots; a run of consecutive slots at consecutive positions is one ``preadv``).
        Returns the bytes read for each pair, short where the file ends early or the read
        failed (the caller treats both as a missing block), or None if the file cannot be
        opened. A page-aligned ``out`` lets the disk write straight into it."""
        try:
            fd, direct = self._open(os.O_RDONLY, direct=is_aligned(out))
        except OSError:
            return None
        got: dict[int, int] = {}
        b = self.block_bytes
        try:
            for pos, slot, count in runs(sorted(slots, key=lambda p: p[1])):
                n = _preadv(fd, out[pos * b : (pos + count) * b], slot * b, direct)
                for k in range(count):
                    got[pos + k] = max(0, min(b, n - k * b))
        finally:
            os.close(fd)
        return [got[pos] for pos, _ in slots]


def _pwritev(fd: int, views: list[memoryview], offset: int) -> None:
    for i in range(0, len(views), IOV_MAX):
        pending = views[i : i + IOV_MAX]
        while pending:
            n = os.pwritev(fd, pending, offset)
            offset += n
            while pending and n >= pending[0].nbytes:
                n -= pending[0].nbytes
                pending = pending[1:]
            if pending and n:
                pending[0] = pending[0][n:]


def _preadv(fd: int, view: memoryview, offset: int, direct: bool) -> int:
    done = 0
    try:
        while done < view.nbytes:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0 or (direct and n % ALIGN):
                return done + max(n, 0)  # the file ended (mid-page, for direct I/O)
            done += n
    except OSError:
        pass
    return done


def lock_directory(directory: Path) -> int:
    """An exclusive flock on ``directory/LOCK``; the kernel releases it if the process dies."""
    fd = os.open(directory / LOCK_FILENAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"disk store at {directory} is already open (in this or another process); "
            "close that store first or use another directory"
        ) from None
    return fd
