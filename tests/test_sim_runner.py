"""`SimulatedRunner`: a decode run's tokens are the ones `execute` samples step by step."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.clock import VirtualClock
from kvpilot.engine.executor import SeqWork
from kvpilot.engine.sampling import SamplingParams
from kvpilot.sim.cost_model import RooflineCostModel
from kvpilot.sim.runner import SimulatedRunner
from kvpilot.sizing.geometry import resolve_geometry
from kvpilot.sizing.hardware import parse_node


def runner(vocab_size: int) -> SimulatedRunner:
    cost = RooflineCostModel(resolve_geometry("llama-3-70b"), parse_node("8xh100"), 8)
    return SimulatedRunner(cost, VirtualClock(), num_blocks=64, vocab_size=vocab_size)


@settings(deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    first=st.integers(0, 200_000),
    steps=st.integers(0, 40),
    vocab=st.sampled_from([2, 101, 32000, 152064]),
)
def test_decode_run_tokens_are_what_execute_samples_step_by_step(
    seed: int, first: int, steps: int, vocab: int
) -> None:
    sim = runner(vocab)
    sampling = SamplingParams(seed=seed)
    one_by_one = [
        sim.execute([SeqWork(7, [1], 5, [0], sampling, step=s, seed=seed)]).tokens[7][0]
        for s in range(first, first + steps)
    ]
    assert sim.decode_run_tokens(seed, first, steps) == one_by_one


def test_several_samples_of_one_step_draw_apart() -> None:
    sim = runner(32000)
    work = SeqWork(3, [1, 2, 3], 0, [0], SamplingParams(seed=9), step=4, seed=9, sample_count=3)
    tokens = sim.execute([work]).tokens[3]
    assert len(tokens) == 3 and len(set(tokens)) == 3
    assert tokens[0] == sim.decode_run_tokens(9, 4, 1)[0]


@settings(deadline=None)
@given(
    seeds=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=12),
    first=st.integers(0, 200_000),
    steps=st.sampled_from([0, 1, 3, 19, 200, 5000]),
    vocab=st.sampled_from([2, 32000, 152064]),
)
def test_many_sequences_draw_what_each_draws_alone(
    seeds: list[int], first: int, steps: int, vocab: int
) -> None:
    sim = runner(vocab)
    firsts = [first + 7 * i for i in range(len(seeds))]
    many = sim.decode_run_tokens_many(seeds, firsts, steps)
    assert many == [sim.decode_run_tokens(s, f, steps) for s, f in zip(seeds, firsts, strict=True)]
    assert all(type(token) is int for tokens in many for token in tokens)
