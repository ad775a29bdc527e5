"""`SimulatedDiskStore`: the engine's disk tier on virtual time.

It answers what the engine asks of a `kvpilot.store.DiskBlockStore` (``put_many``,
``get_async``, ``get_many``, ``contains``, ``delete``, ``stats``), holding keys only (a
simulated block has no bytes). Each read and write takes ``blocks * block_bytes`` over the
disk's bandwidth, queued one after another per direction; a read of a block still being
written starts once that write is done. When every slot is taken a put evicts the least
recently used block, as the real store does.

``block_bytes`` is one device's share of a block (the simulator counts per device of the TP
group) and the bandwidths are that device's share of the node's NVMe: the devices of a group
write their shares of each block at the same time, through one drive.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from kvpilot.engine.clock import VirtualClock
from kvpilot.errors import ConfigError
from kvpilot.store.stats import DiskStoreStats

# What a simulated block "holds": the engine passes it from a disk read to a device write.
BLOCK_STANDIN = b""


class SimulatedIO:
    """A disk read or write on the virtual clock (satisfies `kvpilot.engine.executor.Transfer`):
    done once the clock passes ``finish_s``; waiting on it advances the clock there."""

    __slots__ = ("clock", "finish_s", "value")

    def __init__(self, clock: VirtualClock, finish_s: float, value: Any) -> None:
        self.clock = clock
        self.finish_s = finish_s
        self.value = value

    def done(self) -> bool:
        return self.clock.now() >= self.finish_s

    def result(self, timeout: float | None = None) -> Any:
        self.clock.advance_to(self.finish_s)
        return self.value


class SimulatedDiskStore:
    def __init__(
        self,
        clock: VirtualClock,
        *,
        num_slots: int,
        block_bytes: int,
        read_bytes_per_s: float,
        write_bytes_per_s: float,
    ) -> None:
        if num_slots < 1 or block_bytes < 1 or read_bytes_per_s <= 0 or write_bytes_per_s <= 0:
            raise ConfigError(
                "a simulated disk tier needs num_slots >= 1, block_bytes >= 1 and positive "
                "read and write bandwidths"
            )
        self.clock = clock
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.read_bytes_per_s = float(read_bytes_per_s)
        self.write_bytes_per_s = float(write_bytes_per_s)
        self._ready_at: OrderedDict[bytes, float] = OrderedDict()  # LRU order, oldest first
        self._free_at = {"read": 0.0, "write": 0.0}
        self.blocks_written = 0
        self.blocks_read = 0
        self.misses = 0
        self.evictions = 0

    def _slot(self, direction: str, blocks: int, not_before: float = 0.0) -> float:
        bw = self.read_bytes_per_s if direction == "read" else self.write_bytes_per_s
        start = max(self.clock.now(), self._free_at[direction], not_before)
        finish = start + blocks * self.block_bytes / bw
        self._free_at[direction] = finish
        return finish

    def put_many(self, items: Iterable[tuple[bytes, Any]]) -> SimulatedIO:
        keys = [key for key, _ in items]
        finish = self._slot("write", len(keys))
        stored = []
        for key in keys:
            if key in self._ready_at:
                self._ready_at.move_to_end(key)
            else:
                if len(self._ready_at) >= self.num_slots:
                    self._ready_at.popitem(last=False)
                    self.evictions += 1
                self._ready_at[key] = finish
                self.blocks_written += 1
            stored.append(True)
        return SimulatedIO(self.clock, finish, stored)

    def _read(self, keys: Sequence[bytes]) -> tuple[float, list[bytes | None]]:
        out: list[bytes | None] = []
        not_before = 0.0
        for key in keys:
            ready = self._ready_at.get(key)
            if ready is None:
                out.append(None)
                self.misses += 1
                continue
            self._ready_at.move_to_end(key)
            not_before = max(not_before, ready)
            out.append(BLOCK_STANDIN)
            self.blocks_read += 1
        return self._slot("read", len(keys), not_before), out

    def get_async(self, keys: Sequence[bytes]) -> SimulatedIO:
        finish, out = self._read(keys)
        return SimulatedIO(self.clock, finish, out)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        finish, out = self._read(keys)
        self.clock.advance_to(finish)
        return out

    def contains(self, key: bytes) -> bool:
        return key in self._ready_at

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and key in self._ready_at

    def __len__(self) -> int:
        return len(self._ready_at)

    def delete(self, key: bytes) -> bool:
        return self._ready_at.pop(key, None) is not None

    @property
    def stats(self) -> DiskStoreStats:
        return DiskStoreStats(
            blocks_stored=len(self._ready_at),
            num_slots=self.num_slots,
            queued_writes=0,
            blocks_written=self.blocks_written,
            bytes_written=self.blocks_written * self.block_bytes,
            blocks_read=self.blocks_read,
            bytes_read=self.blocks_read * self.block_bytes,
            hits=self.blocks_read,
            misses=self.misses,
            corrupt=0,
            missing=0,
            evictions=self.evictions,
            write_errors=0,
            read_bw_bytes_s=self.read_bytes_per_s,
            write_bw_bytes_s=self.write_bytes_per_s,
        )

    def check_invariants(self) -> None:
        assert len(self._ready_at) <= self.num_slots, "more blocks stored than slots"

    def close(self) -> None:
        """Nothing to flush: simulated blocks hold no bytes."""
