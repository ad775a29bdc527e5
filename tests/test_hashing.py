from __future__ import annotations

import struct
from hashlib import blake2b

from hypothesis import given
from hypothesis import strategies as st

from kvpilot.memory import block_hash, chain_hashes, root_hash

tokens_st = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=80)


def test_root_hash_is_16_bytes_and_distinguishes_salts() -> None:
    roots = {root_hash(None), root_hash(""), root_hash("tenant-a"), root_hash("tenant-b")}
    assert len(roots) == 4
    assert all(len(h) == 16 for h in roots)


def test_block_hash_is_blake2b_of_parent_and_little_endian_int32() -> None:
    parent = root_hash(None)
    tokens = [1, 2, 300000, -5]
    expected = blake2b(parent + struct.pack("<4i", *tokens), digest_size=16).digest()
    assert block_hash(parent, tokens) == expected


def test_chain_hashes_cover_only_full_blocks() -> None:
    assert len(chain_hashes(list(range(47)), 16)) == 2
    assert len(chain_hashes(list(range(48)), 16)) == 3
    assert chain_hashes(list(range(15)), 16) == []


def test_chained_hash_depends_on_whole_prefix_and_salt() -> None:
    base = list(range(64))
    changed_first_block = [999, *base[1:]]
    hashes = chain_hashes(base, 16)
    assert chain_hashes(changed_first_block, 16)[3] != hashes[3]
    assert chain_hashes(base, 16, salt="tenant")[3] != hashes[3]
    assert chain_hashes(base[16:], 16)[0] != hashes[1]
    assert chain_hashes(base, 16) == hashes


@given(tokens_st, st.integers(1, 8), st.none() | st.text(max_size=5))
def test_chain_hashes_iterate_block_hash_from_the_salts_root(
    tokens: list[int], block_size: int, salt: str | None
) -> None:
    h = root_hash(salt)
    expected = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = block_hash(h, tokens[start : start + block_size])
        expected.append(h)
    assert chain_hashes(tokens, block_size, salt) == expected
