"""The cluster prefix directory: which replica holds which block, in which tier.

Keyed by the engines' chained block hash (`kvpilot.fleet.keys`), fed by each replica's KV
events (`kvpilot.fleet.events`). For a prompt's keys, `match` returns per replica how many
leading blocks it holds and in which tier: the contiguous prefix the replica's radix would
find (device first, then host, then disk: the best copy counts).

Replicas occupy bit positions; each key maps to three bitmasks (device, host, disk) of
the replicas holding it, so one dictionary lookup per block serves every replica at once,
and runs of blocks with the same holders (a shared system prompt) cost one update each.

Sync: each replica's state is (epoch, last applied seq). A batch that does not continue it
(another epoch, or a gap in the sequence numbers) is refused, and the caller resyncs from a
snapshot, which replaces everything known about that replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.errors import ConfigError
from kvpilot.fleet.events import EventBatch, ReplicaSnapshot
from kvpilot.memory.hashing import HASH_BYTES
from kvpilot.memory.tiers import Tier

TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)
_INDEX = {tier: i for i, tier in enumerate(TIERS)}


@dataclass(frozen=True, slots=True)
class TierMatch:
    """Leading blocks of a prompt one replica holds, by the best tier it holds each in."""

    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def blocks(self) -> int:
        return self.device + self.host + self.disk


@dataclass(slots=True)
class _Replica:
    bit: int
    epoch: str | None = None
    last_seq: int = 0
    live: bool = True
    owned: tuple[set[bytes], set[bytes], set[bytes]] = field(
        default_factory=lambda: (set(), set(), set())
    )


class PrefixDirectory:
    def __init__(self, key_space_id: str | None = None) -> None:
        self.key_space_id = key_space_id
        self._holders: dict[bytes, list[int]] = {}
        self._replicas: dict[str, _Replica] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self.resyncs = 0
        self.events_applied = 0

    # -- replicas -------------------------------------------------------------------------

    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def add_replica(self, replica: str) -> None:
        if replica in self._replicas:
            return
        if self._free_bits:
            bit = self._free_bits.pop()
        else:
            bit = 1 << self._next_bit
            self._next_bit += 1
        self._replicas[replica] = _Replica(bit)

    def remove_replica(self, replica: str) -> None:
        """Forget a replica and every block it held (it died, or left the fleet)."""
        state = self._replicas.pop(replica, None)
        if state is None:
            return
        self._clear(state)
        self._free_bits.append(state.bit)

    def set_live(self, replica: str, live: bool) -> None:
        """A replica that is down keeps its entries (it may come back) but matches nothing."""
        self._replicas[replica].live = live

    def is_live(self, replica: str) -> bool:
        state = self._replicas.get(replica)
        return state is not None and state.live

    def sync_state(self, replica: str) -> tuple[str | None, int]:
        """(epoch, last applied seq): what to ask the replica's event log for next."""
        state = self._replicas[replica]
        return state.epoch, state.last_seq

    def num_blocks(self, replica: str, tier: Tier = Tier.DEVICE) -> int:
        return len(self._replicas[replica].owned[_INDEX[tier]])

    # -- feeding --------------------------------------------------------------------------

    def apply(self, replica: str, batch: EventBatch) -> bool:
        """Apply a batch (events already applied are skipped); False, with nothing applied,
        when it does not continue this replica's stream (another epoch, or a gap): the
        caller must `load_snapshot`."""
        state = self._replicas[replica]
        if batch.epoch != state.epoch:
            return False
        if batch.last_seq <= state.last_seq:
            return True  # late: a snapshot or an earlier batch covered all of it
        if batch.first_seq > state.last_seq + 1:
            return False  # a gap: events were lost between the last batch and this one
        bit = state.bit
        applied = 0
        for event in batch.events:
            if event.seq <= state.last_seq:
                continue  # already covered (by a snapshot, or an earlier batch)
            applied += 1
            t = _INDEX[event.tier]
            owned = state.owned[t]
            hashes = event.hashes
            keys = [hashes[i : i + HASH_BYTES] for i in range(0, len(hashes), HASH_BYTES)]
            if event.stored:
                self._store(keys, t, bit, owned)
            else:
                self._drop(keys, t, bit, owned)
            state.last_seq = event.seq
        self.events_applied += applied
        return True

    def load_snapshot(self, replica: str, snapshot: ReplicaSnapshot) -> None:
        if self.key_space_id is not None and snapshot.key_space_id != self.key_space_id:
            raise ConfigError(
                f"replica {replica} hashes blocks under key space {snapshot.key_space_id[:12]}, "
                f"the router under {self.key_space_id[:12]}: it serves another model, block "
                "size or model fingerprint; give every replica the same model and options"
            )
        state = self._replicas[replica]
        self._clear(state)
        for tier, hashes in snapshot.blocks.items():
            t = _INDEX[tier]
            keys = [hashes[i : i + HASH_BYTES] for i in range(0, len(hashes), HASH_BYTES)]
            self._store(keys, t, state.bit, state.owned[t])
        state.epoch = snapshot.epoch
        state.last_seq = snapshot.seq
        self.resyncs += 1

    def _store(self, keys: list[bytes], t: int, bit: int, owned: set[bytes]) -> None:
        holders = self._holders
        for key in keys:
            entry = holders.get(key)
            if entry is None:
                entry = holders[key] = [0, 0, 0]
            entry[t] |= bit
        owned.update(keys)

    def _drop(self, keys: list[bytes], t: int, bit: int, owned: set[bytes]) -> None:
        holders = self._holders
        for key in keys:
            entry = holders.get(key)
            if entry is None:
                continue
            entry[t] &= ~bit
            if not (entry[0] or entry[1] or entry[2]):
                del holders[key]
        owned.difference_update(keys)

    def _clear(self, state: _Replica) -> None:
        for t, owned in enumerate(state.owned):
            self._drop(list(owned), t, state.bit, owned)
        state.epoch = None
        state.last_seq = 0

    # -- lookups --------------------------------------------------------------------------

    def match(self, keys: bytes, replicas: list[str] | None = None) -> dict[str, TierMatch]:
        """Per live replica (of ``replicas``, default all): the leading blocks of ``keys`` it
        holds, by best tier. Replicas holding none are left out."""
        by_bit: dict[int, str] = {}
        alive = 0
        for name in self._replicas if replicas is None else replicas:
            state = self._replicas.get(name)
            if state is not None and state.live:
                by_bit[state.bit] = name
                alive |= state.bit
        counts: dict[int, list[int]] = {}
        holders = self._holders
        run: tuple[int, int, int] | None = None
        run_len = 0
        n = len(keys) // HASH_BYTES
        i = 0
        while i < n and alive:  # hot path: one lookup per block, bit ops for all replicas
            entry = holders.get(keys[i * HASH_BYTES : (i + 1) * HASH_BYTES])
            if entry is None:
                break
            dev, host, disk = entry
            alive &= dev | host | disk
            masks = (dev & alive, host & alive & ~dev, disk & alive & ~dev & ~host)
            if masks != run:
                _flush(counts, run, run_len)
                run, run_len = masks, 0
            run_len += 1
            i += 1
        _flush(counts, run, run_len)
        return {by_bit[bit]: TierMatch(*c) for bit, c in counts.items() if bit in by_bit}

    def check_invariants(self) -> None:
        expected: dict[bytes, list[int]] = {}
        bits = 0
        for name, state in self._replicas.items():
            if state.bit & bits:
                raise AssertionError(f"replica {name} shares its bit with another replica")
            bits |= state.bit
            for t, owned in enumerate(state.owned):
                for key in owned:
                    expected.setdefault(key, [0, 0, 0])[t] |= state.bit
        if expected != self._holders:
            wrong = next(
                k
                for k in set(expected) | set(self._holders)
                if expected.get(k) != self._holders.get(k)
            )
            raise AssertionError(
                f"directory entry {wrong.hex()[:12]} is {self._holders.get(wrong)}, "
                f"replicas' blocks say {expected.get(wrong)}"
            )


def _flush(counts: dict[int, list[int]], run: tuple[int, int, int] | None, n: int) -> None:
    if run is None or not n:
        return
    for t, mask in enumerate(run):
        while mask:
            low = mask & -mask
            entry = counts.get(low)
            if entry is None:
                entry = counts[low] = [0, 0, 0]
            entry[t] += n
            mask ^= low
