"""The ideal hit rate: one infinite prefix cache that every request of the fleet shares.

A request hits the longest block-aligned prefix of its prompt that any earlier computed
context (an earlier prompt, or prompt plus output once finished) shares, leaving at least
one token to compute, exactly as one engine's radix cache would with unlimited memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.fleet.keys import KeySpace, PromptKeyCache
from kvpilot.memory.hashing import HASH_BYTES


class IdealCache:
    def __init__(self, space: KeySpace | None = None) -> None:
        self.space = space or KeySpace()
        self._keys = PromptKeyCache(self.space)
        self._seen: set[bytes] = set()
        self._added: dict[str, int] = {}  # per session: bytes of keys already added

    def lookup(
        self, tokens: Sequence[int], salt: str | None = None, session: str | None = None
    ) -> int:
        """Tokens of ``tokens`` the infinite cache holds; the prompt's blocks join it.
        ``session`` lets a growing session hash only its new blocks."""
        keys = self._keys.keys(tokens, salt, session)
        usable = (len(tokens) - 1) // self.space.block_size
        seen = self._seen
        n = 0
        while n < usable and keys[n * HASH_BYTES : (n + 1) * HASH_BYTES] in seen:
            n += 1
        self._add(keys, session)
        return n * self.space.block_size

    def add(
        self, tokens: Sequence[int], salt: str | None = None, session: str | None = None
    ) -> None:
        self._add(self._keys.keys(tokens, salt, session), session)

    def _add(self, keys: bytes, session: str | None) -> None:
        start = 0
        if session is not None:
            done = self._added.get(session, 0)
            start = done if done <= len(keys) else 0
            self._added[session] = len(keys)
        self._seen.update(keys[i : i + HASH_BYTES] for i in range(start, len(keys), HASH_BYTES))
