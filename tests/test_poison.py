"""Poisoned free blocks: every KV block returned to a free list is overwritten with NaN.

The suite runs with `EngineConfig.poison_freed_blocks` on (tests/conftest.py), so a missed
copy, a wrong slot or a stale block reads NaN or another sequence's KV, never the old
contents that happened to still be right.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.engine import Engine, EngineConfig, SamplingParams
from kvpilot.engine.executor import SeqWork
from kvpilot.memory import BlockPool, Tier
from kvpilot.model.kv_cache import POISON_INT_PATTERN, poison_blocks
from kvpilot.model.runner import ModelRunner

PROMPT = [(7 * i + 3) % 240 + 5 for i in range(70)]


def test_the_suite_runs_with_poisoning_on() -> None:
    assert EngineConfig().runner.poison_freed_blocks
    assert EngineConfig.from_kwargs(kv_blocks=8).runner.poison_freed_blocks
    assert not EngineConfig.from_kwargs(poison_freed_blocks=False).runner.poison_freed_blocks


def test_the_pool_reports_exactly_the_blocks_it_frees() -> None:
    pool = BlockPool(16)
    freed: list[int] = []
    pool.on_free = freed.extend
    a, b, c = pool.allocate(3)
    pool.incref(b)
    pool.decref(a)
    pool.decref(b)  # still held once
    assert freed == [a]
    many = pool.allocate(9)
    pool.incref(many[0])
    pool.decref_many(many)
    assert freed == [a, *many[1:]]
    pool.free([b, c, many[0]])
    assert sorted(freed) == sorted([a, b, c, *many])
    pool.check_invariants()


def _tiered_engine(tiny_model_dir: Path, **options: object) -> Engine:
    return Engine.from_pretrained(
        "tiny", kv_blocks=32, host_kv_blocks=16, cache_dir=tiny_model_dir.parent, **options
    )


def test_freed_device_and_host_blocks_hold_nan(tiny_model_dir: Path) -> None:
    engine = _tiered_engine(tiny_model_dir)
    runner, transport = engine.executor, engine.offload.mover.transport
    assert isinstance(runner, ModelRunner) and transport is not None
    engine.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    held = [b for b in range(32) if engine.kv.device.refcount(b)]
    assert len(held) == len(PROMPT) // 16 and not runner.kv_cache.data[:, :, held].isnan().any()
    engine.kv.radix.evict(len(held))  # the cache lets go of the prompt's blocks
    assert engine.kv.device.num_free == engine.kv.device.num_blocks
    assert runner.kv_cache.data[:, :, held].isnan().all()
    host = engine.kv.pools[Tier.HOST]
    ids = host.allocate(3)
    transport.host[ids] = 1.0  # block-major: blocks are dim 0  # type: ignore[attr-defined]
    host.free(ids)
    assert transport.host[ids].isnan().all()  # type: ignore[attr-defined]
    engine.close()


def test_without_poisoning_freed_blocks_keep_their_contents(tiny_model_dir: Path) -> None:
    engine = _tiered_engine(tiny_model_dir, poison_freed_blocks=False)
    runner = engine.executor
    assert isinstance(runner, ModelRunner)
    engine.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.kv.radix.evict(engine.kv.radix.cached_blocks(Tier.DEVICE))
    assert not runner.kv_cache.data.isnan().any()
    engine.close()


def test_integer_pools_get_a_fixed_garbage_pattern() -> None:
    data = torch.zeros(2, 2, 4, 3, dtype=torch.int16)
    poison_blocks(data, torch.tensor([1, 3]))
    pattern = int.from_bytes(bytes([POISON_INT_PATTERN]) * 2, "little", signed=True)
    assert (data[:, :, [1, 3]] == pattern).all() and (data[:, :, [0, 2]] == 0).all()


def test_decodes_ignore_garbage_past_the_context(tiny_model_dir: Path) -> None:
    """A decode reads its last block's unwritten tail and padding blocks: NaN there must not
    reach the output (a masked score still multiplies its value by 0)."""
    clean = ModelRunner("tiny", num_blocks=16, block_size=16, cache_dir=tiny_model_dir.parent)
    dirty = ModelRunner("tiny", num_blocks=16, block_size=16, cache_dir=tiny_model_dir.parent)
    dirty.kv_cache.data.fill_(float("nan"))
    short, long = PROMPT[:21], PROMPT[:50]
    for runner in (clean, dirty):  # two sequences of different lengths: one is padded
        runner.compute_logits(
            [SeqWork(0, short[:-1], 0, [5, 2]), SeqWork(1, long[:-1], 0, [9, 1, 3, 7])]
        )
    steps = [SeqWork(0, short[-1:], 20, [5, 2]), SeqWork(1, long[-1:], 49, [9, 1, 3, 7])]
    want = clean.compute_logits(steps)
    got = dirty.compute_logits(steps)
    for seq in (0, 1):
        assert not got[seq].isnan().any()
        torch.testing.assert_close(got[seq], want[seq], atol=1e-5, rtol=0)


@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "incref", "decref", "decref_many"]), st.integers(0, 7)),
        max_size=60,
    )
)
def test_on_free_reports_each_release_to_the_free_list_once(ops: list[tuple[str, int]]) -> None:
    pool = BlockPool(16)  # releases of 8 or more blocks take the vectorised path
    reported: list[int] = []
    pool.on_free = reported.extend
    model: dict[int, int] = {}  # block -> refcount
    released: list[int] = []
    for op, arg in ops:
        held = sorted(model)
        if op == "alloc" and pool.num_free:
            for block in pool.allocate(min(1 + arg % 4, pool.num_free)):
                model[block] = 1
        elif op == "incref" and held:
            block = held[arg % len(held)]
            pool.incref(block)
            model[block] += 1
        elif op == "decref" and held:
            block = held[arg % len(held)]
            pool.decref(block)
            model[block] -= 1
        elif op == "decref_many" and held:
            blocks = held[: max(8, 1 + arg % len(held))]  # 8+ when it can: vectorised
            pool.decref_many(blocks)
            for block in blocks:
                model[block] -= 1
        for block in [b for b, n in model.items() if n == 0]:
            released.append(block)
            del model[block]
        assert sorted(reported) == sorted(released)
        pool.check_invariants()
