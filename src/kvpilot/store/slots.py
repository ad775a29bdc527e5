"""The disk store's slot bookkeeping in memory: which key holds which slot (in LRU order),
the free and in-flight slots, pins, and the index changes not committed yet.

Every slot is exactly one of: free, in flight (being written), or held by one stored block.
Not thread-safe: `DiskBlockStore` holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvpilot.errors import InvalidRequest
from kvpilot.memory.hashing import HASH_BYTES
from kvpilot.store.index import IndexEntry

KEY_BYTES = HASH_BYTES


def check_key(key: bytes) -> None:
    """Keys are the 16-byte chained block hashes; anything else is the caller's mistake."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise InvalidRequest(
            f"disk store keys are {KEY_BYTES}-byte chained block hashes "
            f"(kvpilot.memory.hashing.chain_hashes), got {key!r:.60}"
        )


@dataclass(frozen=True, slots=True)
class Planned:
    """A put given a slot: ``item`` is its position in the batch."""

    slot: int
    item: int


class SlotTable:
    def __init__(self, num_slots: int, entries: Iterable[tuple[bytes, IndexEntry]]) -> None:
        self.num_slots = num_slots
        self.entries: OrderedDict[bytes, IndexEntry] = OrderedDict(entries)
        used = {e.slot for e in self.entries.values()}
        self.free = [s for s in range(num_slots - 1, -1, -1) if s not in used]
        self.in_flight: set[int] = set()
        self.pins: dict[bytes, int] = {}
        self.pending_deletes: set[bytes] = set()  # rows to delete at the next commit
        self.touched: set[bytes] = set()  # rows whose access time the next commit writes

    def plan(
        self, keys: Sequence[bytes], now: float
    ) -> tuple[list[bool], dict[bytes, Planned], int]:
        """Slots for a batch of puts, in order (a later key may evict an earlier one): a key
        already stored is touched; each other key takes a free slot, else the least recently
        used unpinned block's, else the oldest slot planned in this batch (that key counts as
        stored, then evicted); a key with none of those is refused (False). Returns the
        results, the planned keys in order, and how many blocks were evicted."""
        results = [True] * len(keys)
        evictions = 0
        planned: dict[bytes, Planned] = {}
        for i, key in enumerate(keys):
            if key in self.entries:
                self.touch(key, now)
                continue
            if key in planned:
                continue
            slot = self.take_free()
            if slot is None:
                slot = self.evict_lru()
                if slot is None and planned:
                    slot = planned.pop(next(iter(planned))).slot
                if slot is None:
                    results[i] = False
                    continue
                evictions += 1
            planned[key] = Planned(slot, i)
        return results, planned, evictions

    def take_free(self) -> int | None:
        """A free slot, now in flight (None when none is free)."""
        if not self.free:
            return None
        slot = self.free.pop()
        self.in_flight.add(slot)
        return slot

    def evict_lru(self) -> int | None:
        """The slot of the least recently used unpinned block, now in flight (its row goes at
        the next commit); None when every stored block is pinned."""
        victim = next((k for k in self.entries if k not in self.pins), None)
        if victim is None:
            return None
        slot = self.forget(victim).slot
        self.in_flight.add(slot)
        return slot

    def written(self, key: bytes, entry: IndexEntry) -> None:
        """A block's bytes and row are committed: its in-flight slot is held now."""
        self.in_flight.discard(entry.slot)
        self.entries[key] = entry

    def abandoned(self, slot: int) -> None:
        """A write into an in-flight slot failed: the slot is free again."""
        self.in_flight.discard(slot)
        self.free.append(slot)

    def touch(self, key: bytes, now: float) -> None:
        self.entries[key].last_access = now
        self.entries.move_to_end(key)
        self.touched.add(key)

    def forget(self, key: bytes) -> IndexEntry:
        """Removes a block from the index (its row at the next commit); its slot is the
        caller's."""
        entry = self.entries.pop(key)
        self.pins.pop(key, None)
        self.touched.discard(key)
        self.pending_deletes.add(key)
        return entry

    def drop(self, key: bytes) -> None:
        """Removes a block; its slot is free."""
        self.free.append(self.forget(key).slot)

    def pin(self, key: bytes) -> bool:
        if key not in self.entries:
            return False
        self.pins[key] = self.pins.get(key, 0) + 1
        return True

    def unpin(self, key: bytes) -> None:
        count = self.pins.get(key, 0)
        if count <= 1:
            self.pins.pop(key, None)
        else:
            self.pins[key] = count - 1

    def take_changes(self) -> tuple[set[bytes], list[tuple[bytes, float]]]:
        """The deletions and access times to commit (handed over: the table forgets them)."""
        deletes, self.pending_deletes = self.pending_deletes, set()
        touches = [(k, self.entries[k].last_access) for k in self.touched if k in self.entries]
        self.touched = set()
        return deletes, touches

    def give_back(self, deletes: set[bytes], touches: list[tuple[bytes, float]]) -> None:
        """Changes `take_changes` handed over that could not be committed."""
        self.pending_deletes |= deletes
        self.touched.update(k for k, _ in touches)

    def check_invariants(self, block_bytes: int) -> None:
        held = [e.slot for e in self.entries.values()]
        assert len(set(held)) == len(held), "two blocks share a slot"
        assert len(set(self.free)) == len(self.free), "a slot is free twice"
        parts = [set(held), set(self.free), self.in_flight]
        assert sum(map(len, parts)) == self.num_slots, "a slot is lost or double-counted"
        assert set().union(*parts) == set(range(self.num_slots)), "a slot is out of range"
        assert all(e.length <= block_bytes for e in self.entries.values())
        assert set(self.pins) <= set(self.entries), "a pin outlived its block"
