"""bench_pause.py's disk figures: the disk store's bandwidth against the raw disk's, same folder.

Raw: sequential writes of 8 MiB chunks with O_DIRECT (page cache bypassed; plain writes and
fsync where the filesystem refuses it), fsync at the end, then the same bytes read back with
O_DIRECT. Store: `DiskBlockStore` (checksums and fsync on, as the engine runs it) writes the
same amount as KV blocks in offloads of 64 blocks, flushes (every batch the writer takes is
fsynced), and reads them back by key, 64 at a time, twice: ``read_into`` a reused page-aligned
buffer (how a loader with its own staging buffer reads: the headline ``disk_read_fraction_raw``)
and ``get_many`` (a new buffer per call, whose fresh pages cost page faults). The page cache is
dropped for the store's files before each read pass (posix_fadvise DONTNEED; the store writes
with direct I/O where it can, so little is cached anyway). Fractions are store / raw; the CPU
seconds (all threads of this process) show what each costs beside the disk's own time.

Standalone: ``python benchmarks/pause_disk.py [--runs 3] [--mib 256] [--dir FOLDER]`` prints a
row per run and one JSON line of medians.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpilot.store import DiskBlockStore
from kvpilot.store.buffers import aligned_buffer

CHUNK = 8 << 20
BATCH = 64


def _open(path: Path, flags: int) -> tuple[int, bool]:
    direct = getattr(os, "O_DIRECT", 0)
    try:
        return os.open(path, flags | direct, 0o644), bool(direct)
    except OSError:
        return os.open(path, flags, 0o644), False


class _Timer:
    """Wall and process CPU seconds of a ``with`` block."""

    def __enter__(self) -> _Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def raw_bandwidth(folder: Path, total_bytes: int) -> dict[str, Any]:
    """Sequential direct I/O in ``folder``: bytes/s and CPU seconds of writing then reading."""
    path = folder / "raw-probe.bin"
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT wants
    buf.write(os.urandom(CHUNK))
    n = max(1, total_bytes // CHUNK)
    fd, direct = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with _Timer() as w:
        try:
            for i in range(n):
                os.pwrite(fd, buf, i * CHUNK)
            os.fsync(fd)
        finally:
            os.close(fd)
    _drop_cache(path)
    fd, _ = _open(path, os.O_RDONLY)
    with _Timer() as r:
        try:
            for i in range(n):
                os.preadv(fd, [buf], i * CHUNK)
        finally:
            os.close(fd)
    path.unlink()
    nbytes = n * CHUNK
    return {
        "write": nbytes / w.wall,
        "read": nbytes / r.wall,
        "write_cpu_s": w.cpu,
        "read_cpu_s": r.cpu,
        "direct": direct,
    }


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def store_bandwidth(folder: Path, total_bytes: int, block_bytes: int) -> dict[str, Any]:
    """The disk store moving ``total_bytes`` of blocks: bytes/s and CPU seconds of the write,
    of reading into a reused buffer, and of ``get_many``."""
    n = max(BATCH, total_bytes // block_bytes)
    blob = os.urandom(block_bytes)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    store = DiskBlockStore(folder / "store", n, block_bytes)
    out: dict[str, Any] = {}

    def drop() -> None:
        for data_file in (folder / "store").iterdir():
            if data_file.is_file():
                _drop_cache(data_file)

    def timed(name: str, body: Callable[[], None]) -> None:
        with _Timer() as t:
            body()
        out[name], out[f"{name}_cpu_s"] = n * block_bytes / t.wall, t.cpu

    def write() -> None:
        futures = [
            store.put_many([(k, blob) for k in keys[i : i + BATCH]]) for i in range(0, n, BATCH)
        ]
        store.flush()
        assert all(all(f.result()) for f in futures)

    staging = aligned_buffer(BATCH * block_bytes)  # a loader's reused staging buffer

    def read_into() -> None:
        for i in range(0, n, BATCH):
            got = store.read_into(keys[i : i + BATCH], staging)
            assert all(g == block_bytes for g in got)

    def get_many() -> None:
        for i in range(0, n, BATCH):
            got = store.get_many(keys[i : i + BATCH])
            assert all(g is not None for g in got)

    try:
        timed("write", write)
        drop()
        timed("read", read_into)
        drop()
        timed("get_many", get_many)
    finally:
        store.close()
    return out


def disk_figures(folder: Path, total_bytes: int, block_bytes: int) -> dict[str, Any]:
    raw = raw_bandwidth(folder, total_bytes)
    st = store_bandwidth(folder, total_bytes, block_bytes)
    return {
        "raw_write_mb_s": round(raw["write"] / 1e6, 1),
        "raw_read_mb_s": round(raw["read"] / 1e6, 1),
        "raw_direct_io": raw["direct"],
        "store_write_mb_s": round(st["write"] / 1e6, 1),
        "store_read_mb_s": round(st["read"] / 1e6, 1),
        "store_get_many_mb_s": round(st["get_many"] / 1e6, 1),
        "disk_write_fraction_raw": round(st["write"] / raw["write"], 3),
        "disk_read_fraction_raw": round(st["read"] / raw["read"], 3),
        "disk_get_many_fraction_raw": round(st["get_many"] / raw["read"], 3),
        "cpu_s": {
            "raw_write": round(raw["write_cpu_s"], 3),
            "raw_read": round(raw["read_cpu_s"], 3),
            "store_write": round(st["write_cpu_s"], 3),
            "store_read": round(st["read_cpu_s"], 3),
            "store_get_many": round(st["get_many_cpu_s"], 3),
        },
        "block_bytes": block_bytes,
        "total_bytes": total_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mib", type=int, default=256, help="bytes moved per pass, in MiB")
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--dir", default=None, help="folder on the disk to measure (temp)")
    args = parser.parse_args()
    cols = (
        "raw_write_mb_s",
        "store_write_mb_s",
        "disk_write_fraction_raw",
        "raw_read_mb_s",
        "store_read_mb_s",
        "disk_read_fraction_raw",
        "store_get_many_mb_s",
        "disk_get_many_fraction_raw",
    )
    print("run " + " ".join(f"{c.replace('_mb_s', ''):>14s}" for c in cols) + "  cpu_s")
    runs = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="kvpilot-disk-", dir=args.dir) as folder:
            fig = disk_figures(Path(folder), args.mib << 20, args.block_kib << 10)
        runs.append(fig)
        print(f"{run:3d} " + " ".join(f"{fig[c]:14,.3f}" for c in cols) + f"  {fig['cpu_s']}")
        sys.stdout.flush()
    medians = {c: round(statistics.median(r[c] for r in runs), 3) for c in cols}
    print(json.dumps({"runs": args.runs, "mib": args.mib, **medians}))


if __name__ == "__main__":
    main()
