"""Counters and measured bandwidth of the disk tier (the pause policy reads the bandwidth)."""

from __future__ import annotations

from dataclasses import dataclass, field


class BandwidthEma:
    """Exponential moving average of bytes/s over recent transfers (one sample per batch).

    The first sample sets the average; until then it is 0.0, meaning "not measured yet".
    """

    __slots__ = ("_alpha", "_value")

    def __init__(self, alpha: float = 0.25) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self._alpha = alpha
        self._value = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0.0:
            return
        sample = nbytes / seconds
        self._value = (
            sample if self._value == 0.0 else self._value + self._alpha * (sample - self._value)
        )

    @property
    def bytes_per_s(self) -> float:
        return self._value


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
    read_bw: BandwidthEma = field(default_factory=BandwidthEma)
    write_bw: BandwidthEma = field(default_factory=BandwidthEma)

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
            read_bw_bytes_s=self.read_bw.bytes_per_s,
            write_bw_bytes_s=self.write_bw.bytes_per_s,
        )
