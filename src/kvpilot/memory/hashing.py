"""The one definition of the chained block hash (prefix cache, disk tier and router key on it).

``h_k = blake2b_16(h_{k-1} || tokens_k as little-endian int32)``, seeded by
``root_hash(salt, model)``, so a block's hash names its whole prefix, its tenant and the model
whose KV it is (a `ModelFingerprint`: weights identity, KV dtype, block size, config). Every
key that outlives a process or is shared (disk tier, fleet directory) therefore never mixes
models.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

HASH_BYTES = 16
NATIVE_LITTLE_ENDIAN = sys.byteorder == "little"


def int32_bytes(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian int32 bytes."""
    arr = tokens if isinstance(tokens, array) and tokens.typecode == "i" else array("i", tokens)
    if not NATIVE_LITTLE_ENDIAN:
        arr = array("i", arr)
        arr.byteswap()
    return arr.tobytes()


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """Names whose KV a block is: ``digest`` (HASH_BYTES) seeds the chained hash, ``label``
    says in words what it names (for log lines)."""

    digest: bytes
    label: str

    def __post_init__(self) -> None:
        if len(self.digest) != HASH_BYTES:
            raise ValueError(f"a model fingerprint is {HASH_BYTES} bytes, got {len(self.digest)}")

    @classmethod
    def of(cls, description: str) -> ModelFingerprint:
        """The fingerprint of a model known only by a description (e.g. a simulated one)."""
        digest = blake2b(description.encode("utf-8"), digest_size=HASH_BYTES).digest()
        return cls(digest, description)


def root_hash(salt: str | None, model: bytes = b"") -> bytes:
    """The seed of a tenant's chain; ``model`` is a `ModelFingerprint` digest (empty: none)."""
    seed = b"kvpilot/root" if salt is None else b"kvpilot/salt:" + salt.encode("utf-8")
    if model:
        seed = b"kvpilot/model:" + model + b"/" + seed
    return blake2b(seed, digest_size=HASH_BYTES).digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return blake2b(parent + int32_bytes(tokens), digest_size=HASH_BYTES).digest()


def chain_bytes(parent: bytes, token_bytes: bytes | memoryview, block_size: int) -> bytes:
    """Concatenated chained hashes of every full block in ``token_bytes`` (little-endian int32)."""
    step = 4 * block_size
    data = memoryview(token_bytes)
    out: list[bytes] = []
    append = out.append
    h = parent
    for start in range(0, len(data) - step + 1, step):  # hot path
        h = blake2b(h + data[start : start + step], digest_size=HASH_BYTES).digest()
        append(h)
    return b"".join(out)


def chain_hashes(
    tokens: Sequence[int], block_size: int, salt: str | None = None, model: bytes = b""
) -> list[bytes]:
    joined = chain_bytes(root_hash(salt, model), int32_bytes(tokens), block_size)
    return [joined[i : i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES)]
