"""bench_pause.py's disk figures: the disk store's bandwidth against the raw disk's, same folder.

Raw: sequential writes of 8 MiB chunks with O_DIRECT (page cache bypassed; plain writes and
fsync where the filesystem refuses it), fsync at the end, then the same bytes read back with
O_DIRECT. Store: `DiskBlockStore` (checksums and fsync on, as the engine runs it) writes the
same amount as KV blocks in batches of 64, flushes, and reads them back by key. The page
cache is dropped for the file first where the OS allows it (posix_fadvise DONTNEED), so the
reads come from the disk. Fractions are store / raw.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path
from typing import Any

from kvpilot.store import DiskBlockStore

CHUNK = 8 << 20
BATCH = 64


def _open(path: Path, flags: int) -> tuple[int, bool]:
    direct = getattr(os, "O_DIRECT", 0)
    try:
        return os.open(path, flags | direct, 0o644), bool(direct)
    except OSError:
        return os.open(path, flags, 0o644), False


def raw_bandwidth(folder: Path, total_bytes: int) -> tuple[float, float, bool]:
    """(write bytes/s, read bytes/s, direct I/O used) of sequential I/O in ``folder``."""
    path = folder / "raw-probe.bin"
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT wants
    buf.write(os.urandom(CHUNK))
    n = max(1, total_bytes // CHUNK)
    fd, direct = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    start = time.perf_counter()
    try:
        for i in range(n):
            os.pwrite(fd, buf, i * CHUNK)
        os.fsync(fd)
    finally:
        os.close(fd)
    write_bw = n * CHUNK / (time.perf_counter() - start)
    _drop_cache(path)
    fd, _ = _open(path, os.O_RDONLY)
    start = time.perf_counter()
    try:
        for i in range(n):
            os.preadv(fd, [buf], i * CHUNK)
    finally:
        os.close(fd)
    read_bw = n * CHUNK / (time.perf_counter() - start)
    path.unlink()
    return write_bw, read_bw, direct


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def store_bandwidth(folder: Path, total_bytes: int, block_bytes: int) -> tuple[float, float]:
    """(write bytes/s, read bytes/s) of the disk store moving ``total_bytes`` of blocks."""
    n = max(BATCH, total_bytes // block_bytes)
    blob = os.urandom(block_bytes)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    store = DiskBlockStore(folder / "store", n, block_bytes)
    try:
        start = time.perf_counter()
        futures = [
            store.put_many([(k, blob) for k in keys[i : i + BATCH]]) for i in range(0, n, BATCH)
        ]
        store.flush()
        assert all(all(f.result()) for f in futures)
        write_bw = n * block_bytes / (time.perf_counter() - start)
        for data_file in (folder / "store").iterdir():
            if data_file.is_file():
                _drop_cache(data_file)
        start = time.perf_counter()
        for i in range(0, n, BATCH):
            got = store.get_many(keys[i : i + BATCH])
            assert all(g is not None for g in got)
        read_bw = n * block_bytes / (time.perf_counter() - start)
    finally:
        store.close()
    return write_bw, read_bw


def disk_figures(folder: Path, total_bytes: int, block_bytes: int) -> dict[str, Any]:
    raw_w, raw_r, direct = raw_bandwidth(folder, total_bytes)
    st_w, st_r = store_bandwidth(folder, total_bytes, block_bytes)
    return {
        "raw_write_mb_s": round(raw_w / 1e6, 1),
        "raw_read_mb_s": round(raw_r / 1e6, 1),
        "raw_direct_io": direct,
        "store_write_mb_s": round(st_w / 1e6, 1),
        "store_read_mb_s": round(st_r / 1e6, 1),
        "disk_write_fraction_raw": round(st_w / raw_w, 3),
        "disk_read_fraction_raw": round(st_r / raw_r, 3),
        "block_bytes": block_bytes,
        "total_bytes": total_bytes,
    }
