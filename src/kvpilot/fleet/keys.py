"""Directory keys: the engines' own chained block hash of a prompt.

A directory hit must be a real engine hit, so the router fingerprints a prompt with the
memory core's hash (`kvpilot.memory.hashing`): the same 16-token blocks, the same tenant
salt and the same seed, which carries the model fingerprint (weights, dtype, block size,
config: `ModelFingerprint`). A `KeySpace` is that block size and fingerprint, taken from
the engines themselves (`KeySpace.of_radix`, or a replica's hello); every replica also
reports the seed it hashes under (``key_space_id``: its root hash for the anonymous
tenant), and the directory refuses a replica whose seed differs from the router's,
rather than mixing models silently.

Keys are 16-byte hashes concatenated in one ``bytes`` (key ``i`` is
``keys[16 * i : 16 * i + 16]``): one allocation per prompt, sliced on demand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

from kvpilot.memory.hashing import HASH_BYTES, chain_bytes, int32_bytes, root_hash
from kvpilot.memory.radix import RadixCache


@dataclass(frozen=True, slots=True)
class KeySpace:
    """How prompts are cut and hashed: block size, and the model fingerprint digest that
    seeds each salt's chain (empty: an engine without one)."""

    block_size: int = 16
    model: bytes = b""

    @classmethod
    def of_radix(cls, radix: RadixCache) -> KeySpace:
        """The key space an engine's radix cache hashes under."""
        return cls(radix.block_size, radix.model)

    def root(self, salt: str | None) -> bytes:
        return root_hash(salt, self.model)

    @property
    def key_space_id(self) -> str:
        """What a replica hashing under this key space reports (its anonymous root, hex)."""
        return self.root(None).hex()

    def keys(self, tokens: Sequence[int], salt: str | None = None) -> bytes:
        """The chained hash of every full block of ``tokens``, concatenated."""
        return chain_bytes(self.root(salt), int32_bytes(tokens), self.block_size)

    def extend(self, keys: bytes, tokens: Sequence[int], salt: str | None = None) -> bytes:
        """``keys`` of a prefix, extended over ``tokens`` (which continue that prefix at a
        block boundary: ``len(keys) // 16`` blocks were hashed already)."""
        parent = keys[-HASH_BYTES:] if keys else self.root(salt)
        return keys + chain_bytes(parent, int32_bytes(tokens), self.block_size)


def num_keys(keys: bytes) -> int:
    return len(keys) // HASH_BYTES


def key_at(keys: bytes, i: int) -> bytes:
    return keys[i * HASH_BYTES : (i + 1) * HASH_BYTES]


class PromptKeyCache:
    """Keys of each session's last prompt, so a growing session hashes only its new blocks.

    A session's next prompt usually extends its last one. The cache keeps, per session, the
    keys and one digest of the tokens they cover; a prompt whose prefix has that digest
    reuses them and hashes only the rest (one digest over the prefix is far cheaper than a
    chained hash call per block).
    """

    def __init__(self, space: KeySpace, max_entries: int = 65536) -> None:
        self.space = space
        self.max_entries = max_entries
        self._entries: dict[tuple[str, str | None], tuple[int, bytes, bytes]] = {}

    def keys(self, tokens: Sequence[int], salt: str | None, session: str | None) -> bytes:
        bs = self.space.block_size
        data = int32_bytes(tokens)
        if session is None:
            return chain_bytes(self.space.root(salt), data, bs)
        entry = self._entries.pop((session, salt), None)
        keys = b""
        view = memoryview(data)
        if entry is not None:
            covered, digest, old_keys = entry
            if covered <= len(data) and _digest(view[:covered]) == digest:
                keys = old_keys
        done = len(keys) // HASH_BYTES * 4 * bs
        parent = keys[-HASH_BYTES:] if keys else self.space.root(salt)
        keys += chain_bytes(parent, view[done:], bs)
        covered = len(keys) // HASH_BYTES * 4 * bs
        if len(self._entries) >= self.max_entries:
            self._entries.pop(next(iter(self._entries)))
        self._entries[(session, salt)] = (covered, _digest(view[:covered]), keys)
        return keys

    def forget(self, session: str) -> None:
        for key in [k for k in self._entries if k[0] == session]:
            del self._entries[key]


def _digest(data: memoryview) -> bytes:
    return blake2b(data, digest_size=16).digest()
