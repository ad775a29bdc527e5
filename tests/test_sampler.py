"""Sampler: greedy, temperature, top-k, top-p, and seeded reproducibility per (seed, step)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.sampling import SamplingParams
from kvpilot.model.sampler import Sampler, SampleRow, gumbel_noise, row_key

SAMPLER = Sampler()
HOT = SamplingParams(temperature=1.0)


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draw(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> int:
    return SAMPLER.sample(logits[None], [SampleRow(params, seed, step)])[0]


def test_greedy_takes_the_argmax_of_every_row() -> None:
    logits = _logits(8)
    rows = [SampleRow(SamplingParams(), seed=i, step=i) for i in range(8)]
    assert SAMPLER.sample(logits, rows) == logits.argmax(dim=-1).tolist()


def test_seeded_sampling_is_reproducible() -> None:
    logits = _logits(1)[0]
    first = [_draw(logits, HOT, seed=11, step=s) for s in range(20)]
    again = [_draw(logits, HOT, seed=11, step=s) for s in range(20)]
    assert first == again


def test_sampled_token_depends_on_step_and_seed() -> None:
    flat = torch.zeros(1000)
    by_step = {_draw(flat, HOT, seed=3, step=s) for s in range(10)}
    by_seed = {_draw(flat, HOT, seed=s, step=3) for s in range(10)}
    assert len(by_step) > 5
    assert len(by_seed) > 5


def test_a_row_samples_the_same_token_in_any_batch() -> None:
    logits = _logits(6)
    rows = [SampleRow(HOT if i % 2 else SamplingParams(), seed=100 + i, step=i) for i in range(6)]
    batched = SAMPLER.sample(logits, rows)
    alone = [SAMPLER.sample(logits[i : i + 1], [rows[i]])[0] for i in range(6)]
    reordered = SAMPLER.sample(logits.flip(0), rows[::-1])[::-1]
    assert batched == alone == reordered


def test_top_k_one_is_greedy() -> None:
    logits = _logits(16, seed=1)
    rows = [SampleRow(SamplingParams(temperature=2.0, top_k=1), seed=i, step=0) for i in range(16)]
    assert SAMPLER.sample(logits, rows) == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_is_greedy() -> None:
    logits = _logits(16, seed=2)
    params = SamplingParams(temperature=2.0, top_p=1e-6)
    rows = [SampleRow(params, seed=i, step=5) for i in range(16)]
    assert SAMPLER.sample(logits, rows) == logits.argmax(dim=-1).tolist()


def test_sample_frequencies_follow_the_softmax() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = 8000
    logits = probs.log().expand(draws, 4)
    rows = [SampleRow(HOT, seed=5, step=s) for s in range(draws)]
    counts = torch.bincount(torch.tensor(SAMPLER.sample(logits, rows)), minlength=4)
    expected = probs * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # p = 0.001 for 3 degrees of freedom


def test_temperature_scales_the_distribution() -> None:
    logits = torch.tensor([1.0, 0.0]).expand(4000, 2)
    for temperature in (0.5, 2.0):
        params = SamplingParams(temperature=temperature)
        rows = [SampleRow(params, seed=9, step=s) for s in range(4000)]
        share = sum(t == 0 for t in SAMPLER.sample(logits, rows)) / 4000
        expected = 1 / (1 + math.exp(-1 / temperature))
        assert share == pytest.approx(expected, abs=0.03)


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20), min_size=2, max_size=40),
    top_k=st.integers(0, 45),
    top_p=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**40),
    step=st.integers(0, 10_000),
)
def test_sampled_token_lies_in_the_top_k_and_nucleus(
    logits: list[float], top_k: int, top_p: float, seed: int, step: int
) -> None:
    values = torch.tensor(logits)
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    token = _draw(values, params, seed, step)
    as_fp32 = values.tolist()
    order = sorted(range(len(logits)), key=lambda i: (-as_fp32[i], i))
    rank = order.index(token)
    if top_k:
        assert rank < top_k
    kept = order[: top_k or len(logits)]
    probs = torch.softmax(values[kept], dim=0)
    assert float(probs[:rank].sum()) < top_p + 1e-5


def test_gumbel_noise_is_a_function_of_key_and_token_only() -> None:
    keys = torch.tensor([row_key(1, 2), row_key(1, 3)])
    wide = gumbel_noise(keys, 64)
    narrow = gumbel_noise(keys[1:], 16)
    assert torch.equal(wide[1, :16], narrow[0])
    assert not torch.equal(wide[0], wide[1])
    assert torch.isfinite(wide).all()
