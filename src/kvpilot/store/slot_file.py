"""The disk tier's data file: ``num_slots`` fixed-size slots, and the directory lock.

Slot ``s`` holds a block's bytes at ``[s * block_bytes, s * block_bytes + length)``. The file
is opened per batch rather than held open, so a file deleted or replaced behind the store's back
is noticed (a held descriptor would keep reading the unlinked inode).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Sequence
from hashlib import blake2b
from pathlib import Path

from kvpilot.errors import ConfigError

DATA_FILENAME = "blocks.dat"
LOCK_FILENAME = "LOCK"
CHECKSUM_BYTES = 16


def checksum(data: bytes | memoryview) -> bytes:
    return blake2b(data, digest_size=CHECKSUM_BYTES).digest()


class SlotFile:
    def __init__(self, directory: Path, num_slots: int, block_bytes: int) -> None:
        self.path = directory / DATA_FILENAME
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.full_size = num_slots * block_bytes

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

    def write(self, writes: Sequence[tuple[int, bytes]], *, fsync: bool) -> None:
        """Writes each ``(slot, data)``; with ``fsync`` the data is on stable storage on return."""
        fd = os.open(self.path, os.O_WRONLY)
        try:
            for slot, data in sorted(writes):
                view = memoryview(data)
                offset = slot * self.block_bytes
                while view:
                    n = os.pwrite(fd, view, offset)
                    view, offset = view[n:], offset + n
            if fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def read(self, reads: Sequence[tuple[int, int]]) -> list[bytes] | None:
        """Bytes of each ``(slot, length)``: short where the file ends early or the read failed
        (the caller treats both as a missing block); None if the file cannot be opened."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            return [self._read_one(fd, slot, length) for slot, length in reads]
        finally:
            os.close(fd)

    def _read_one(self, fd: int, slot: int, length: int) -> bytes:
        try:
            return os.pread(fd, length, slot * self.block_bytes)
        except OSError:
            return b""


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
