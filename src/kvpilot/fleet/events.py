"""KV events: what each replica tells the directory about the blocks it holds.

A replica's radix cache reports every change of residency to its `KVEventLog` (the
radix's one observer): blocks **committed** (newly indexed on device), **moved** (a copy
arrived in a tier: host or disk after an offload, device after a load back) and
**evicted** (a copy left a tier). Each event gets the replica's next sequence number.

The router pulls events with ``since(after_seq)``. The log keeps the last ``capacity``
events; a reader that fell further behind (a gap), or a replica that restarted (a new
``epoch``), gets ``None`` and must resync from a `ReplicaSnapshot`, which carries every
block the replica holds per tier and the sequence number it is current to.

    replica radix --committed/moved/evicted--> KVEventLog (seq 1, 2, 3, ...)
          router: since(7) -> EventBatch(events 8..12)  |  None -> snapshot() -> resync
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from kvpilot.memory.hashing import HASH_BYTES
from kvpilot.memory.radix import RadixCache
from kvpilot.memory.tiers import Tier


class KVEventKind(StrEnum):
    COMMITTED = "committed"
    MOVED = "moved"
    EVICTED = "evicted"


@dataclass(frozen=True, slots=True)
class KVEvent:
    """``hashes``: the blocks' chained hashes, 16 bytes each, concatenated."""

    seq: int
    kind: KVEventKind
    tier: Tier
    hashes: bytes

    @property
    def num_blocks(self) -> int:
        return len(self.hashes) // HASH_BYTES

    @property
    def stored(self) -> bool:
        return self.kind is not KVEventKind.EVICTED


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events ``first_seq .. last_seq`` of one replica epoch (empty when nothing changed)."""

    epoch: str
    last_seq: int
    events: tuple[KVEvent, ...]

    @property
    def first_seq(self) -> int:
        return self.events[0].seq if self.events else self.last_seq + 1


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """Every block a replica indexes, per tier, as of event ``seq`` of ``epoch``."""

    epoch: str
    seq: int
    key_space_id: str
    blocks: dict[Tier, bytes] = field(default_factory=dict)

    def num_blocks(self, tier: Tier) -> int:
        return len(self.blocks.get(tier, b"")) // HASH_BYTES


class KVEventLog:
    """The replica side: numbers the radix's changes and keeps the recent ones.

    Attach it with ``KVEventLog(radix)``; from then on every commit, move and eviction is an
    event (the radix calls `committed`, `moved`, `evicted`). ``epoch`` is fresh per log, so
    a restarted replica is told apart from one that kept its state.
    """

    def __init__(self, radix: RadixCache, capacity: int = 65536, epoch: str | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"an event log needs capacity >= 1, got {capacity}")
        self.radix = radix
        self.capacity = capacity
        self.epoch = epoch or secrets.token_hex(8)
        self.seq = 0
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        radix.set_observer(self)

    def detach(self) -> None:
        if self.radix.observer is self:
            self.radix.set_observer(None)

    # -- the radix observer ---------------------------------------------------------------

    def _append(self, kind: KVEventKind, tier: Tier, hashes: bytes) -> None:
        if hashes:
            self.seq += 1
            self._events.append(KVEvent(self.seq, kind, tier, hashes))

    def committed(self, hashes: bytes) -> None:
        self._append(KVEventKind.COMMITTED, Tier.DEVICE, hashes)

    def moved(self, tier: Tier, hashes: bytes) -> None:
        self._append(KVEventKind.MOVED, tier, hashes)

    def evicted(self, tier: Tier, hashes: bytes) -> None:
        self._append(KVEventKind.EVICTED, tier, hashes)

    # -- readers --------------------------------------------------------------------------

    def since(self, after_seq: int, epoch: str | None = None) -> EventBatch | None:
        """Events after ``after_seq``, or None when the reader must resync (gap, new epoch)."""
        if epoch is not None and epoch != self.epoch:
            return None
        if after_seq > self.seq or after_seq < 0:
            return None
        oldest = self._events[0].seq if self._events else self.seq + 1
        if after_seq + 1 < oldest:
            return None
        # The newest events sit at the right end: walk back only over the ones asked for.
        wanted = self.seq - after_seq
        events = tuple(reversed(tuple(itertools.islice(reversed(self._events), wanted))))
        return EventBatch(self.epoch, self.seq, events)

    def snapshot(self, key_space_id: str) -> ReplicaSnapshot:
        """Every block the radix indexes now, per tier (current to event ``self.seq``)."""
        parts: dict[Tier, list[bytes]] = {}
        for node in self.radix.iter_nodes():
            if node.is_root:
                continue
            hashes = node.hashes
            for tier in node.blocks:
                parts.setdefault(tier, []).append(hashes)
        blocks = {tier: b"".join(chunks) for tier, chunks in parts.items()}
        return ReplicaSnapshot(self.epoch, self.seq, key_space_id, blocks)
