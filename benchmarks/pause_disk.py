"""bench_pause.py's disk figures: the disk store's bandwidth against the raw disk's, same folder.

The bytes are one random buffer of ``--mib`` (not one block repeated: copies and checksums
then run from memory, not from cache, as the engine's do). Raw: sequential writes of it in
8 MiB chunks with O_DIRECT (page cache bypassed; plain writes and fsync where the filesystem
refuses it), fsync at the end, then read back with O_DIRECT. Store: `DiskBlockStore`
(checksums and fsync on, as the engine runs it) writes the same bytes as KV blocks (each a
``bytes`` object, as the engine's device reads hand them over) in offloads of 64 blocks,
flushes (every batch the writer takes is fsynced before it counts as stored), and reads them
back by key, 64 at a time, twice: ``get_many`` (what the engine's
loader calls: the headline ``disk_read_fraction_raw``) and ``read_into`` a reused page-aligned
buffer. The page cache is dropped for the store's files before each read pass
(posix_fadvise DONTNEED; the store writes with direct I/O where it can, so little is cached
anyway). Each store pass runs right after the raw pass it is compared with, as the disk's
speed drifts on a shared machine, and the order of each pair swaps from run to run (the
second writer of a pair may pay for the first one's write-back below a VM). Fractions are
store / raw; the CPU seconds (all threads of this process, per 256 MiB moved) show what each
pass costs beside the disk's own time, and do not depend on how loaded the machine is.

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

import numpy as np

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


class _Raw:
    """Sequential direct I/O of ``data`` in 8 MiB chunks to a file in ``folder``."""

    def __init__(self, folder: Path, data: memoryview) -> None:
        self.path = folder / "raw-probe.bin"
        self.data = data  # page-aligned, as O_DIRECT wants
        self.buf = mmap.mmap(-1, CHUNK)  # what reads land in, mapped before they start
        self.buf.write(bytes(CHUNK))
        self.n = max(1, data.nbytes // CHUNK)
        self.direct = False

    def write(self) -> None:
        fd, self.direct = _open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            for i in range(self.n):
                os.pwrite(fd, self.data[i * CHUNK : (i + 1) * CHUNK], i * CHUNK)
            os.fsync(fd)
        finally:
            os.close(fd)
        _drop_cache(self.path)

    def read(self) -> None:
        fd, _ = _open(self.path, os.O_RDONLY)
        try:
            for i in range(self.n):
                os.preadv(fd, [self.buf], i * CHUNK)
        finally:
            os.close(fd)


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_figures(
    folder: Path, total_bytes: int, block_bytes: int, *, store_first: bool = False
) -> dict[str, Any]:
    """Raw and store side by side, each store pass next to the raw pass it is compared with
    (the disk's speed drifts on a shared machine): raw write, store write, raw read, store
    ``get_many``, then store ``read_into``; ``store_first`` swaps each pair (the second
    writer of a pair may pay for the first one's write-back below the VM)."""
    n = max(BATCH, total_bytes // block_bytes)
    data = aligned_buffer(max(n * block_bytes, CHUNK))
    np.frombuffer(data, np.uint8)[:] = np.frombuffer(
        np.random.default_rng(0).bytes(data.nbytes), np.uint8
    )
    raw = _Raw(folder, data[: max(CHUNK, n * block_bytes // CHUNK * CHUNK)])
    blocks = [bytes(data[i * block_bytes : (i + 1) * block_bytes]) for i in range(n)]
    keys = [i.to_bytes(16, "little") for i in range(n)]
    store = DiskBlockStore(folder / "store", n, block_bytes)
    staging = aligned_buffer(BATCH * block_bytes, populate=True)  # a loader's reused staging
    rate: dict[str, float] = {}
    cpu: dict[str, float] = {}

    def timed(name: str, nbytes: int, body: Callable[[], None]) -> None:
        with _Timer() as t:
            body()
        rate[name], cpu[name] = nbytes / t.wall, round(t.cpu * (256 << 20) / nbytes, 3)

    def store_write() -> None:
        futures = [
            store.put_many(list(zip(keys[i : i + BATCH], blocks[i : i + BATCH], strict=True)))
            for i in range(0, n, BATCH)
        ]
        store.flush()
        assert all(all(f.result()) for f in futures)
        for data_file in (folder / "store").iterdir():
            if data_file.is_file():
                _drop_cache(data_file)

    def get_many() -> None:
        for i in range(0, n, BATCH):
            got = store.get_many(keys[i : i + BATCH])
            assert all(g is not None for g in got)

    def read_into() -> None:
        for i in range(0, n, BATCH):
            got = store.read_into(keys[i : i + BATCH], staging)
            assert all(g == block_bytes for g in got)

    try:
        passes = [
            [
                ("raw_write", raw.n * CHUNK, raw.write),
                ("store_write", n * block_bytes, store_write),
            ],
            [("raw_read", raw.n * CHUNK, raw.read), ("store_read", n * block_bytes, get_many)],
        ]
        for pair in passes:
            for name, nbytes, body in reversed(pair) if store_first else pair:
                timed(name, nbytes, body)
        for data_file in (folder / "store").iterdir():
            if data_file.is_file():
                _drop_cache(data_file)
        timed("store_read_into", n * block_bytes, read_into)
    finally:
        store.close()
        raw.path.unlink(missing_ok=True)
    return {
        **{f"{k}_mb_s": round(v / 1e6, 1) for k, v in rate.items()},
        "raw_direct_io": raw.direct,
        "disk_write_fraction_raw": round(rate["store_write"] / rate["raw_write"], 3),
        "disk_read_fraction_raw": round(rate["store_read"] / rate["raw_read"], 3),
        "disk_read_into_fraction_raw": round(rate["store_read_into"] / rate["raw_read"], 3),
        "cpu_s_per_256mib": cpu,
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
        "store_read_into_mb_s",
        "disk_read_into_fraction_raw",
    )
    print(
        "run first "
        + " ".join(f"{c.replace('_mb_s', ''):>14s}" for c in cols)
        + "  CPU s per 256 MiB"
    )
    runs = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="kvpilot-disk-", dir=args.dir) as folder:
            fig = disk_figures(
                Path(folder), args.mib << 20, args.block_kib << 10, store_first=run % 2 == 1
            )
        runs.append(fig)
        first = "store" if run % 2 else "raw  "
        row = " ".join(f"{fig[c]:14,.3f}" for c in cols)
        print(f"{run:3d} {first} {row}  {fig['cpu_s_per_256mib']}")
        sys.stdout.flush()
    medians = {c: round(statistics.median(r[c] for r in runs), 3) for c in cols}
    passes = runs[0]["cpu_s_per_256mib"]
    cpu = {p: round(statistics.median(r["cpu_s_per_256mib"][p] for r in runs), 3) for p in passes}
    print(json.dumps({"runs": args.runs, "mib": args.mib, **medians, "cpu_s_per_256mib": cpu}))


if __name__ == "__main__":
    main()
