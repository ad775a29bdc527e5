"""`SimulatedRunner`: a decode run's tokens are the ones `execute` samples step by step."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.clock import VirtualClock
from kvpilot.engine.executor import SeqWork
from kvpilot.engine.sampling import SamplingParams
from kvpilot.sim import runner as runner_module
from kvpilot.sim.batch_shape import batch_shape
from kvpilot.sim.cost_model import RooflineCostModel
from kvpilot.sim.profile import CalibratedCostModel, StepProfile
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
    asks=st.lists(
        st.tuples(
            st.sampled_from([3, 11, 2**64 - 1]),  # few seeds: streams are asked for again
            st.integers(0, 3000),
            st.integers(0, 60),
            st.integers(0, 2000),
        ),
        min_size=1,
        max_size=25,
    ),
    vocab=st.sampled_from([2, 32000, 152064]),
    kept=st.sampled_from([1, 2, 4096]),
)
def test_token_streams_hold_what_each_step_draws(
    asks: list[tuple[int, int, int, int]], vocab: int, kept: int
) -> None:
    # However the streams kept were drawn (how far ahead, from where, and which seeds were
    # forgotten), each answer holds what execute samples at the steps asked for.
    sim = runner(vocab)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner_module, "_STREAM_SEEDS", kept)
        ask_streams(sim, asks, kept)


def ask_streams(sim: SimulatedRunner, asks: list[tuple[int, int, int, int]], kept: int) -> None:
    for seed, first, steps, ahead in asks:
        stream = sim.decode_run_stream(seed, first, steps, ahead)
        a = first - stream.first
        assert a >= 0 and a + steps <= len(stream.ids)
        assert stream.ids[a : a + steps].tolist() == sim.decode_run_tokens(seed, first, steps)
        assert len(sim._streams) <= kept


def test_a_stream_is_drawn_once_for_the_runs_of_a_sequence() -> None:
    sim = runner(32000)
    stream = sim.decode_run_stream(5, 10, 18, ahead=300)
    assert stream.first == 10 and len(stream.ids) == 300
    for first in range(10, 300, 18):  # the runs that follow slice it
        assert sim.decode_run_stream(5, first, min(18, 310 - first), ahead=310 - first) is stream
    later = sim.decode_run_stream(5, 305, 18, ahead=18)  # past its end: drawn again
    assert later.first == 305 and later.ids.tolist() == sim.decode_run_tokens(5, 305, 18)


def test_a_stream_longer_than_the_offsets_kept_draws_the_same() -> None:
    sim = runner(152064)
    stream = sim.decode_run_stream(2**64 - 1, 123_456, 5000)
    assert stream.ids.tolist() == sim.decode_run_tokens(2**64 - 1, 123_456, 5000)


@settings(deadline=None, max_examples=60)
@given(
    steps=st.lists(
        st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(1, 20)), max_size=3),
        min_size=1,
        max_size=8,
    )
)
def test_execute_counts_recomputed_positions_and_the_shape_of_each_step(
    steps: list[list[tuple[int, int, int]]],
) -> None:
    """Recomputed tokens: the positions a work computes below its sequence's high-water mark
    (counted one by one here); each step's shape is `batch_shape` of its works."""
    sim = runner(32000)
    marks: dict[int, int] = {}
    expected = 0
    for step in steps:
        by_seq = {seq_id: (start, count) for seq_id, start, count in step}  # one work a seq
        works = [SeqWork(s, [1] * c, p, [0]) for s, (p, c) in by_seq.items()]
        for s, (p, c) in by_seq.items():
            expected += sum(1 for q in range(p, p + c) if q < marks.get(s, 0))
            marks[s] = max(marks.get(s, 0), p + c)
        sim.execute(works)
        assert sim.recomputed_tokens == expected
        assert sim.last_shape == batch_shape(works)


def test_a_recorded_decode_run_needs_one_position_per_sequence() -> None:
    sim = runner(32000)
    with pytest.raises(ValueError, match="one position per sequence"):
        sim.record_decode_run(  # type: ignore[arg-type]
            [SimpleNamespace(seq_id=1), SimpleNamespace(seq_id=2)], [10], [0.01, 0.01]
        )
    assert (sim.steps, sim.busy_s) == (0, 0.0)  # and nothing counted


def calibrated_runner(distinct_s: float) -> SimulatedRunner:
    profile = StepProfile(
        "t", "cpu", "float32", 4, (1e-3, 2e-5, 3e-4, 1e-7, 1e-9, distinct_s), 1e-5, 20, 1, 0
    )
    return SimulatedRunner(CalibratedCostModel(profile), VirtualClock(), num_blocks=64)


@settings(deadline=None, max_examples=100)
@given(
    steps=st.lists(
        st.lists(
            st.tuples(
                st.integers(0, 30),
                st.integers(1, 9),
                st.lists(st.integers(0, 12), min_size=10, max_size=10),
            ),
            max_size=5,
        ),
        min_size=1,
        max_size=5,
    )
)
def test_a_runner_whose_cost_model_reads_distinct_kv_counts_it_as_batch_shape_does(
    steps: list[list[tuple[int, int, list[int]]]],
) -> None:
    """Works' block tables drawn from a few ids share blocks whole or in part; a cost model
    with a zero distinct-KV coefficient needs no count, and gets none."""
    counting, plain = calibrated_runner(6e-8), calibrated_runner(0.0)
    assert counting._distinct_kv and not plain._distinct_kv
    for step in steps:
        works = [SeqWork(i, [1] * c, p, table) for i, (p, c, table) in enumerate(step)]
        counting.execute(works)
        plain.execute(works)
        assert counting.last_shape == batch_shape(works, block_size=4)
        assert plain.last_shape == batch_shape(works)
        assert counting.clock.now() >= plain.clock.now()


@settings(deadline=None, max_examples=60)
@given(
    heads=st.lists(st.integers(0, 4), min_size=1, max_size=6),
    tail=st.integers(0, 3),
    steps=st.integers(2, 9),
)
def test_the_last_shape_of_a_decode_run_carries_the_kv_its_steps_share(
    heads: list[int], tail: int, steps: int
) -> None:
    """Sequences sharing a head of whole blocks (ids 0..) then on their own blocks: the
    run's last step has the shape `batch_shape` gives that step's works."""
    sim = calibrated_runner(6e-8)
    positions = [4 * h + tail for h in heads]
    tables = [list(range(h)) + [100 * (i + 1) + j for j in range(9)] for i, h in enumerate(heads)]
    running = [
        SimpleNamespace(seq_id=i, traj=SimpleNamespace(block_table=t)) for i, t in enumerate(tables)
    ]
    durations, _ = sim.decode_run_clock(positions, 0.0, math.inf, steps, running)  # type: ignore[arg-type]
    sim.record_decode_run(running, positions, durations)  # type: ignore[arg-type]
    last = [
        SeqWork(i, [1], p + steps - 1, t)
        for i, (p, t) in enumerate(zip(positions, tables, strict=True))
    ]
    assert sim.last_shape == batch_shape(last, block_size=4)
