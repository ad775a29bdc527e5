"""The models the suite tests on notice wrong KV: every output depends on the whole context.

An equivalence test ("the output is identical with and without this cache decision") proves
nothing on a model that ignores its context. These tests pin, for the built-in `tiny` and
for every checkpoint factory, that changing the first of 48 prompt tokens usually changes the
greedy continuation, that changing any single earlier token changes the next-token logits,
and that corrupting any one cached block of KV changes them beyond 1e-3.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvpilot.engine import Engine, SamplingParams
from kvpilot.engine.executor import SeqWork
from kvpilot.model.checkpoints import ARCHITECTURES
from kvpilot.model.runner import ModelRunner

PROMPT_TOKENS = 48
CASES = 20
CONTINUATION = SamplingParams(max_tokens=6, ignore_eos=True)
BLOCK = 16
LOGIT_CHANGE = 1e-3


def random_prompts(seed: int, n: int = CASES) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, PROMPT_TOKENS).tolist() for _ in range(n)]


def with_token_changed(prompt: list[int], position: int, seed: int) -> list[int]:
    changed = list(prompt)
    changed[position] = (prompt[position] + 1 + seed % 255) % 256
    return changed


def first_token_flips(engine: Engine, seed: int = 0) -> int:
    """Of CASES random prompts, how many change their greedy 6-token continuation when only
    their first token changes."""
    prompts = random_prompts(seed)
    changed = [with_token_changed(p, 0, seed + i) for i, p in enumerate(prompts)]
    outs = engine.generate(prompts + changed, CONTINUATION)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(a != b for a, b in zip(tokens[:CASES], tokens[CASES:], strict=True))


def last_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    table = list(range(-(-len(prompt) // runner.block_size)))
    return runner.compute_logits([SeqWork(0, prompt, 0, table)])[0]


def block_corruption_changes(
    runner: ModelRunner, prompt: list[int], other: list[int]
) -> list[float]:
    """Max |logit change| of the last position when each cached block of the prompt's first
    47 tokens (two full, one partial) holds another prompt's KV instead (stale KV from another
    sequence at the same positions)."""
    bs = runner.block_size
    head, last = prompt[:-1], prompt[-1:]
    table = list(range(-(-len(prompt) // bs)))
    spare = len(table)  # a block past the prompt's own, for the other prompt's KV
    clean = runner.compute_logits([SeqWork(0, prompt, 0, table)])[0]
    changes = []
    for b in range(-(-len(head) // bs)):
        runner.compute_logits([SeqWork(1, other[: (b + 1) * bs], 0, [*table[:b], spare])])
        runner.compute_logits([SeqWork(0, head, 0, table)])
        runner.copy_blocks([(spare, table[b])])
        corrupted = runner.compute_logits([SeqWork(0, last, len(head), table)])[0]
        changes.append(float((corrupted - clean).abs().max()))
    return changes


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir: Path) -> Engine:
    return Engine.from_pretrained("tiny", kv_blocks=256, cache_dir=tiny_model_dir.parent)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def factory_engine(request: pytest.FixtureRequest, hf_checkpoint: Callable[[str], Path]) -> Engine:
    # One KV pool for every layer: these checks drive the runner with block tables by hand
    # (the sliding-window group's own tables are the engine's; tests/test_window_release.py).
    return Engine.from_pretrained(
        str(hf_checkpoint(request.param)), kv_blocks=256, release_window_blocks=False
    )


def test_tiny_continuation_changes_with_the_first_of_48_tokens(tiny_engine: Engine) -> None:
    flips = first_token_flips(tiny_engine)
    print(f"tiny: first-token change alters the 6-token continuation in {flips}/{CASES}")
    assert flips >= 12


def test_factory_continuation_changes_with_the_first_of_48_tokens(factory_engine: Engine) -> None:
    assert first_token_flips(factory_engine, seed=1) >= 12


def test_tiny_logits_change_with_any_single_earlier_token(tiny_engine: Engine) -> None:
    assert_every_earlier_token_matters(runner_of(tiny_engine))


def test_factory_logits_change_with_any_single_earlier_token(factory_engine: Engine) -> None:
    assert_every_earlier_token_matters(runner_of(factory_engine))


def test_tiny_logits_change_with_any_one_corrupted_block(tiny_engine: Engine) -> None:
    assert_every_cached_block_matters(runner_of(tiny_engine))


def test_factory_logits_change_with_any_one_corrupted_block(factory_engine: Engine) -> None:
    assert_every_cached_block_matters(runner_of(factory_engine))


def runner_of(engine: Engine) -> ModelRunner:
    runner = engine.executor
    assert isinstance(runner, ModelRunner) and runner.block_size == BLOCK
    return runner


def assert_every_earlier_token_matters(runner: ModelRunner) -> None:
    for prompt in random_prompts(2, n=3):
        clean = last_logits(runner, prompt)
        for position in range(len(prompt) - 1):
            changed = last_logits(runner, with_token_changed(prompt, position, position))
            assert (changed - clean).abs().max() > LOGIT_CHANGE, position


def assert_every_cached_block_matters(runner: ModelRunner) -> None:
    prompts = random_prompts(3, n=6)
    for prompt, other in zip(prompts[:3], prompts[3:], strict=True):
        changes = block_corruption_changes(runner, prompt, other)
        assert len(changes) == 3 and min(changes) > LOGIT_CHANGE, changes
