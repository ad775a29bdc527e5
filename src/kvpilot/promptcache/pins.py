"""Cache breakpoints with a time-to-live: the table of pinned prefixes.

A breakpoint asks that the prompt prefix up to it be kept for its TTL. The engine caches
whole blocks, so a breakpoint at token p pins the first ``p // B * B`` tokens (a partial
block is never cached, as everywhere in the engine). A pin is keyed by the tenant's salt
and the chained hash of the pinned tokens (the same key the radix, the disk tier and the
router use), so any later request whose prompt starts with those tokens finds it, whichever
breakpoints it marks itself (the provider's "lookback").

Each hit refreshes the pin's expiry to ``now + ttl``; when the TTL lapses unrefreshed, the
pin is released: its hold on the KV is dropped and a request no longer reads it.

    tokens:  |------ pinned (1h) ------|---- pinned (5m) ----|-- after the last breakpoint --|
             0                       a1                     a2                             n
             (longer TTLs must come first: a 5m breakpoint before a 1h one is refused)

The table is pure: holding KV is delegated to a `Holder` (the engine's radix locks), and
time comes from an injected clock, so tests run TTLs on virtual time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvpilot.memory.hashing import chain_hashes

H = TypeVar("H")


class Holder(Protocol[H]):
    """Keeps the KV of a prefix from being evicted while pinned."""

    def hold(self, salt: str | None, tokens: Sequence[int]) -> tuple[H, int] | None:
        """Hold the cached prefix of ``tokens``: a handle and how many tokens it covers
        (None if none of it is cached)."""
        ...

    def release(self, handle: H) -> None: ...


@dataclass(slots=True)
class Pin(Generic[H]):
    salt: str | None
    key: bytes  # chained hash of the pinned tokens
    tokens: int  # pinned length (whole blocks)
    ttl_s: float
    expires_at: float
    handle: H
    tier: str = "device"
    hits: int = 0


@dataclass(frozen=True, slots=True)
class PinResult:
    """What pinning the breakpoints of one request did."""

    created: tuple[tuple[int, float], ...]  # (pinned tokens, ttl) of each new pin
    refreshed: tuple[int, ...]  # pinned tokens of each pin that already existed
    over_budget: tuple[int, ...] = ()  # not pinned: the pin budget was full


class PinTable(Generic[H]):
    def __init__(
        self,
        block_size: int,
        holder: Holder[H],
        clock: Callable[[], float],
        budget_tokens: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.holder = holder
        self.now = clock
        # Most tokens held by pins at once (each pin counted whole, shared prefixes again):
        # pinned KV must leave the engine room to run. None: no limit.
        self.budget_tokens = budget_tokens
        self.held_tokens = 0
        self._pins: dict[tuple[str | None, bytes], Pin[H]] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def __iter__(self) -> Iterator[Pin[H]]:
        return iter(list(self._pins.values()))

    def _prefix_keys(self, tokens: Sequence[int], salt: str | None) -> list[bytes]:
        """The chained hash after each full block of ``tokens``."""
        n = len(tokens) // self.block_size * self.block_size
        return chain_hashes(list(tokens[:n]), self.block_size, salt)

    def expire(self) -> int:
        """Release every pin whose TTL has lapsed; returns how many."""
        now = self.now()
        lapsed = [k for k, p in self._pins.items() if p.expires_at <= now]
        for k in lapsed:
            self._drop(k)
        return len(lapsed)

    def _drop(self, key: tuple[str | None, bytes]) -> None:
        pin = self._pins.pop(key)
        self.held_tokens -= pin.tokens
        self.holder.release(pin.handle)

    def longest_live(self, tokens: Sequence[int], salt: str | None) -> Pin[H] | None:
        """The longest live pin that is a prefix of ``tokens`` (expired ones released)."""
        self.expire()
        if not self._pins:
            return None
        keys = self._prefix_keys(tokens, salt)
        for key in reversed(keys):
            pin = self._pins.get((salt, key))
            if pin is not None:
                return pin
        return None

    def touch(self, tokens: Sequence[int], salt: str | None, upto: int) -> None:
        """A request read the prefix up to ``upto``: every pin inside it lives on."""
        now = self.now()
        keys = self._prefix_keys(tokens[:upto], salt)
        for key in keys:
            pin = self._pins.get((salt, key))
            if pin is not None:
                pin.expires_at = max(pin.expires_at, now + pin.ttl_s)
                pin.hits += 1

    def pin(
        self, tokens: Sequence[int], salt: str | None, breakpoints: Sequence[tuple[int, float]]
    ) -> PinResult:
        """Pin ``tokens[:p]`` for ``ttl`` for each breakpoint (p, ttl), p block-aligned."""
        self.expire()
        now = self.now()
        keys = self._prefix_keys(tokens, salt)
        created: list[tuple[int, float]] = []
        refreshed: list[int] = []
        over: list[int] = []
        for p, ttl in breakpoints:
            if p < self.block_size or p % self.block_size:
                raise ValueError(f"breakpoint {p} is not a positive multiple of the block size")
            key = keys[p // self.block_size - 1]
            pin = self._pins.get((salt, key))
            if pin is not None:
                pin.ttl_s = max(pin.ttl_s, ttl)
                pin.expires_at = max(pin.expires_at, now + ttl)
                refreshed.append(p)
                continue
            if self.budget_tokens is not None and self.held_tokens + p > self.budget_tokens:
                over.append(p)
                continue
            held = self.holder.hold(salt, tokens[:p])
            if held is None:
                continue
            handle, covered = held
            if covered < p:  # evicted before it could be pinned: nothing is written
                self.holder.release(handle)
                continue
            self._pins[(salt, key)] = Pin(salt, key, p, ttl, now + ttl, handle)
            self.held_tokens += p
            created.append((p, ttl))
        return PinResult(tuple(created), tuple(refreshed), tuple(over))

    def release_all(self) -> None:
        for key in list(self._pins):
            self._drop(key)

    def check_invariants(self) -> None:
        total = sum(p.tokens for p in self._pins.values())
        if total != self.held_tokens:
            raise AssertionError(f"pins hold {total} tokens, the table counts {self.held_tokens}")
        if self.budget_tokens is not None and total > self.budget_tokens:
            raise AssertionError(f"pins hold {total} tokens, over the budget {self.budget_tokens}")
        for (salt, key), pin in self._pins.items():
            if pin.salt != salt or pin.key != key:
                raise AssertionError(f"pin of {pin.tokens} tokens filed under another key")
            if pin.tokens % self.block_size or pin.tokens <= 0:
                raise AssertionError(f"pin of {pin.tokens} tokens is not whole blocks")
