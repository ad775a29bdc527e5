"""Counters and measured bandwidth of the disk tier (the pause policy reads the bandwidth)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.policy.meters import RateMeter
from kvpilot.store.index import IndexEntry
from kvpilot.store.slots import SlotTable

STORE_BW_ALPHA = 0.25


@dataclass(frozen=True, slots=True)
class DiskStoreStats:
    """A consistent snapshot of a DiskBlockStore's counters.

    ``misses`` counts every lookup that returned None, including the ``corrupt`` (checksum or
    length mismatch) and ``missing`` (data file deleted or shorter than the slot end) ones.
    ``blocks_read``/``bytes_read`` count verified blocks returned to callers. The bandwidths are
    effective rates (file I/O plus checksums, and fsync for writes), what a reload really costs.
    """

    blocks_stored: int
    num_slots: int
    queued_writes: int
    blocks_written: int
    bytes_written: int
    blocks_read: int
    bytes_read: int
    hits: int
    misses: int
    corrupt: int
    missing: int
    evictions: int
    write_errors: int
    read_bw_bytes_s: float
    write_bw_bytes_s: float


@dataclass(slots=True)
class StoreCounters:
    """Mutable counters behind DiskStoreStats; the store guards them with its lock."""

    blocks_written: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    missing: int = 0
    evictions: int = 0
    write_errors: int = 0
    read_bw: RateMeter = field(default_factory=lambda: RateMeter(alpha=STORE_BW_ALPHA))
    write_bw: RateMeter = field(default_factory=lambda: RateMeter(alpha=STORE_BW_ALPHA))

    def snapshot(self, *, blocks_stored: int, num_slots: int, queued_writes: int) -> DiskStoreStats:
        return DiskStoreStats(
            blocks_stored=blocks_stored,
            num_slots=num_slots,
            queued_writes=queued_writes,
            blocks_written=self.blocks_written,
            bytes_written=self.bytes_written,
            blocks_read=self.blocks_read,
            bytes_read=self.bytes_read,
            hits=self.hits,
            misses=self.misses,
            corrupt=self.corrupt,
            missing=self.missing,
            evictions=self.evictions,
            write_errors=self.write_errors,
            read_bw_bytes_s=self.read_bw.get(0.0),
            write_bw_bytes_s=self.write_bw.get(0.0),
        )


def account_reads(
    slots: SlotTable,
    c: StoreCounters,
    found: list[tuple[int, bytes, IndexEntry | None]],
    verdicts: dict[int, str],
    nbytes: int,
    elapsed: float,
    now: float,
) -> list[int | None]:
    """Counts a batch of reads (``found``: position, key, row or None; ``verdicts``: "ok",
    "corrupt" or "missing" per position read) and drops the rows of damaged blocks; returns
    each position's verified length, None for a miss. The store holds its lock."""
    out: list[int | None] = [None] * len(found)
    if verdicts:
        c.read_bw.observe(nbytes, elapsed)
    for i, key, entry in found:
        verdict = "absent" if entry is None else verdicts[i]
        if verdict == "ok":
            assert entry is not None
            out[i] = entry.length
            c.hits += 1
            c.blocks_read += 1
            c.bytes_read += entry.length
            if slots.entries.get(key) is entry:
                slots.touch(key, now)
            continue
        c.misses += 1
        # A block evicted or dropped while we read it is a plain miss, not damage.
        if verdict != "absent" and slots.entries.get(key) is entry:
            slots.drop(key)
            if verdict == "corrupt":
                c.corrupt += 1
            else:
                c.missing += 1
    return out
