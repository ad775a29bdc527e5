from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.errors import ConfigError, OutOfBlocks
from kvpilot.memory import BlockPool, Tier


def test_allocate_returns_distinct_blocks_with_refcount_one() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert all(pool.refcount(b) == 1 for b in blocks)
    assert pool.num_free == 5 and pool.num_used == 3


def test_free_list_is_lifo() -> None:
    pool = BlockPool(8)
    a, b = pool.allocate(2)
    pool.decref(a)
    pool.decref(b)
    assert pool.allocate(1) == [b]
    assert pool.allocate(1) == [a]


def test_out_of_blocks_has_no_side_effect_on_the_pool() -> None:
    pool = BlockPool(4, Tier.HOST)
    pool.allocate(3)
    with pytest.raises(OutOfBlocks) as info:
        pool.allocate(2)
    assert (info.value.tier, info.value.requested, info.value.free) == (Tier.HOST, 2, 1)
    assert "host" in str(info.value)
    assert pool.num_free == 1
    pool.check_invariants()


def test_decref_returns_true_only_when_block_goes_back_to_free_list() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref(b)
    assert pool.decref(b) is False
    assert pool.num_free == 1
    assert pool.decref(b) is True
    assert pool.num_free == 2


def test_free_decrefs_each_block() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    pool.incref(blocks[0])
    pool.free(blocks)
    assert pool.refcount(blocks[0]) == 1 and pool.num_free == 3


def test_refcounting_a_free_block_is_rejected() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="free"):
        pool.incref(0)
    with pytest.raises(ValueError, match="free"):
        pool.decref(1)
    with pytest.raises(ValueError, match="out of range"):
        pool.refcount(2)


def test_incref_many_matches_incref_and_rejects_free_blocks_without_side_effect() -> None:
    pool = BlockPool(32)
    blocks = pool.allocate(20)
    pool.incref_many(blocks[:12])
    assert [pool.refcount(b) for b in blocks] == [2] * 12 + [1] * 8
    pool.decref(blocks[5])
    pool.decref(blocks[5])
    with pytest.raises(ValueError):
        pool.incref_many(blocks[:12])
    assert pool.refcount(blocks[0]) == 2


def test_usage_is_used_over_total() -> None:
    pool = BlockPool(10)
    assert pool.usage == 0.0
    pool.allocate(4)
    assert pool.usage == pytest.approx(0.4)
    assert BlockPool(0).usage == 0.0


def test_can_allocate() -> None:
    pool = BlockPool(3)
    assert pool.can_allocate(3) and not pool.can_allocate(4) and not pool.can_allocate(-1)


def test_negative_size_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        BlockPool(-1)


def test_check_invariants_catches_corrupted_refcount() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool._refcounts[b] = 0
    with pytest.raises(AssertionError, match="refcount 0"):
        pool.check_invariants()
    pool._refcounts[b] = 1
    pool._refcounts[3] = 2
    with pytest.raises(AssertionError, match="free block 3"):
        pool.check_invariants()


@given(st.lists(st.tuples(st.sampled_from(["alloc", "incref", "decref"]), st.integers(0, 7))))
def test_pool_agrees_with_a_refcount_model(ops: list[tuple[str, int]]) -> None:
    pool = BlockPool(8)
    model: dict[int, int] = {}
    for op, arg in ops:
        held = sorted(model)
        if op == "alloc":
            n = arg % 4
            if n > pool.num_free:
                with pytest.raises(OutOfBlocks):
                    pool.allocate(n)
            else:
                for b in pool.allocate(n):
                    assert b not in model
                    model[b] = 1
        elif held:
            b = held[arg % len(held)]
            if op == "incref":
                pool.incref(b)
                model[b] += 1
            else:
                model[b] -= 1
                assert pool.decref(b) is (model[b] == 0)
                if model[b] == 0:
                    del model[b]
        pool.check_invariants()
        assert pool.num_used == len(model)
        assert all(pool.refcount(b) == c for b, c in model.items())


def test_decref_many_returns_blocks_that_became_free() -> None:
    pool = BlockPool(32)
    blocks = pool.allocate(20)
    pool.incref_many(blocks[:5])
    assert pool.decref_many(blocks) == 15
    assert pool.num_free == 27
    assert all(pool.refcount(b) == 1 for b in blocks[:5])
    with pytest.raises(ValueError, match="free"):
        pool.decref_many(blocks)
    assert all(pool.refcount(b) == 1 for b in blocks[:5])
    pool.check_invariants()


def test_decref_many_rejects_a_free_or_out_of_range_block_without_side_effect() -> None:
    pool = BlockPool(16)
    blocks = pool.allocate(10)
    pool.incref_many(blocks[:4])
    free_block = pool.allocate(1)[0]
    pool.decref(free_block)
    for bad in (free_block, -1, 16):
        with pytest.raises(ValueError):
            pool.decref_many([*blocks[:4], bad, *blocks[4:]])
        with pytest.raises(ValueError):
            pool.incref_many([*blocks[:4], bad])
        assert [pool.refcount(b) for b in blocks] == [2] * 4 + [1] * 6
        assert pool.num_free == 6
    pool.check_invariants()


def test_decref_one_is_decref_many_of_one_block() -> None:
    pools = BlockPool(8), BlockPool(8)
    hooked: list[list[list[int]]] = [[], []]
    for pool, seen in zip(pools, hooked, strict=True):
        pool.on_free = seen.append
        assert pool.allocate(4) == [0, 1, 2, 3]
        pool.incref(2)
    one, many = pools
    for block in (3, 2, 2, 1, 0):  # 2 is held twice: its first release frees nothing
        assert one.decref_one(block) == many.decref_many([block])
        assert one._free == many._free
        assert one.refcounts().tolist() == many.refcounts().tolist()
    assert hooked[0] == hooked[1] == [[3], [2], [1], [0]]
    one.check_invariants()


def test_decref_one_rejects_a_free_or_out_of_range_block_without_side_effect() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(8)
    pool.decref(5)
    for bad in (5, -1, 8, -9):  # free; -1 would index block 7 (in use); past either end
        with pytest.raises(ValueError):
            pool.decref_one(bad)
        assert [pool.refcount(b) for b in blocks] == [1] * 5 + [0] + [1] * 2
        assert pool.num_free == 1
    pool.check_invariants()


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["alloc", "incref_many", "decref_many"]),
            st.lists(st.integers(0, 11), max_size=6, unique=True),
            st.sampled_from([None, "free", -1, 12]),
        ),
        max_size=40,
    )
)
def test_many_block_calls_agree_with_a_refcount_model(
    ops: list[tuple[str, list[int], int | str | None]],
) -> None:
    """incref_many / decref_many (one pass, undone on a bad id) against per-block counts;
    a free or out-of-range id anywhere in the list leaves every count and the free list."""
    pool = BlockPool(12)
    model: dict[int, int] = {}
    for op, picks, bad in ops:
        if op == "alloc":
            for b in pool.allocate(min(len(picks), pool.num_free)):
                model[b] = 1
            continue
        held = sorted(model)
        blocks = [held[i % len(held)] for i in picks] if held else []
        blocks = list(dict.fromkeys(blocks))  # distinct ids
        if bad is not None:
            bad_id = next((b for b in range(12) if b not in model), None) if bad == "free" else bad
            if isinstance(bad_id, int):
                before = dict(model), list(pool._free)
                at = picks[0] % (len(blocks) + 1) if picks else 0
                with pytest.raises(ValueError):
                    getattr(pool, op)([*blocks[:at], bad_id, *blocks[at:]])
                assert (dict(model), list(pool._free)) == before
                assert all(pool.refcount(b) == c for b, c in model.items())
                pool.check_invariants()
                continue
        if op == "incref_many":
            pool.incref_many(blocks)
            for b in blocks:
                model[b] += 1
        else:
            freed = pool.decref_many(blocks)
            for b in blocks:
                model[b] -= 1
            gone = [b for b in blocks if model[b] == 0]
            assert freed == len(gone)
            assert pool._free[len(pool._free) - len(gone) :] == gone  # freed in list order
            for b in gone:
                del model[b]
        pool.check_invariants()
        assert all(pool.refcount(b) == c for b, c in model.items())
