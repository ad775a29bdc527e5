"""The simulator's cost models: the roofline (spec Napkin Math 0.5) and measured profiles."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.clock import VirtualClock
from kvpilot.engine.executor import SeqWork
from kvpilot.errors import ConfigError
from kvpilot.sim.batch_shape import (
    BatchShape,
    batch_shape,
    decode_run_shape,
    shape_of,
    shared_kv_tokens,
    window_pairs,
)
from kvpilot.sim.cost_model import RooflineCostModel
from kvpilot.sim.profile import PROFILE_FEATURES, CalibratedCostModel, StepProfile
from kvpilot.sizing.geometry import ModelGeometry, resolve_geometry
from kvpilot.sizing.hardware import Accelerator, Node, parse_node
from kvpilot.sizing.layers import FULL, WINDOW, LayerGroup

# Napkin Math 0.5: 70B parameters in 16-bit (140 GB), 800 TFLOP/s, 3.0 TB/s, one device.
NAPKIN_MODEL = ModelGeometry("napkin-70b", 80, 8, 128, 70e9, "bf16", "bf16", 8192, 64)
NAPKIN_ACCEL = Accelerator("napkin", 160 * 2**30, 3.0e12, 800e12, 64e9, "PCIe", 256 * 10**9)
NAPKIN_NODE = Node(NAPKIN_ACCEL, 1)


def napkin(mfu: float) -> RooflineCostModel:
    return RooflineCostModel(
        NAPKIN_MODEL, NAPKIN_NODE, 1, mfu=mfu, hbm_efficiency=1.0, step_overhead_s=0.0
    )


def test_decode_of_32_streams_is_memory_bound_at_46_7_ms() -> None:
    cost = napkin(0.5).cost(shape_of(decode_seqs=32))
    assert cost.memory_s == pytest.approx(140e9 / 3e12, rel=1e-3)
    assert cost.compute_s == pytest.approx(11.2e-3, rel=1e-3)
    assert cost.bound == "memory"
    assert cost.time_s == pytest.approx(46.7e-3, rel=2e-3)


def test_monolithic_4096_prefill_is_compute_bound_near_1_195_s() -> None:
    model = napkin(0.6)
    cost = model.cost(shape_of(prefill_tokens=4096))
    assert cost.bound == "compute"
    assert cost.linear_flops / 480e12 == pytest.approx(1.1947, rel=1e-3)
    assert cost.attention_flops == 4 * 80 * 64 * 128 * (4096 * 4097 // 2)
    assert cost.time_s == pytest.approx(1.195, rel=0.05)
    assert cost.time_s > cost.linear_flops / 480e12


def test_chunk_of_512_with_32_decodes_takes_158_7_ms() -> None:
    cost = napkin(0.6).cost(shape_of(prefill_tokens=512, decode_seqs=32))
    assert cost.bound == "compute"
    assert cost.linear_flops / 480e12 == pytest.approx(158.7e-3, rel=1e-3)
    assert cost.time_s == pytest.approx(158.7e-3, rel=0.01)


def test_step_time_adds_the_fixed_overhead_and_matches_the_breakdown() -> None:
    base = napkin(0.5)
    slow = RooflineCostModel(
        NAPKIN_MODEL, NAPKIN_NODE, 1, mfu=0.5, hbm_efficiency=1.0, step_overhead_s=0.002
    )
    shape = shape_of(prefill_tokens=100, decode_seqs=7, context_tokens=900)
    assert base.step_time_s(shape) == pytest.approx(base.cost(shape).time_s)
    assert slow.step_time_s(shape) == pytest.approx(base.step_time_s(shape) + 0.002)
    assert base.step_time_s(BatchShape()) == 0.0


def test_tensor_parallelism_splits_weights_and_compute_per_device() -> None:
    g = resolve_geometry("llama-3-70b")
    node = parse_node("8xh100")
    one = RooflineCostModel(g, node, 1, step_overhead_s=0.0)
    eight = RooflineCostModel(g, node, 8, step_overhead_s=0.0)
    decode = shape_of(decode_seqs=16, context_tokens=2000)
    prefill = shape_of(prefill_tokens=2048)
    assert eight.step_time_s(decode) == pytest.approx(one.step_time_s(decode) / 8, rel=1e-6)
    assert eight.step_time_s(prefill) == pytest.approx(one.step_time_s(prefill) / 8, rel=1e-6)
    assert eight.replicas == 1 and one.replicas == 8


def test_long_context_decode_pays_for_reading_its_kv() -> None:
    model = RooflineCostModel(resolve_geometry("llama-3-8b"), parse_node("h100"), 1)
    short = model.step_time_s(shape_of(decode_seqs=64, context_tokens=1000))
    long = model.step_time_s(shape_of(decode_seqs=64, context_tokens=32000))
    kv = model.kv_bytes_per_token * 64 * 31000
    assert long - short == pytest.approx(kv / (3.35e12 * 0.8), rel=1e-3)


def test_block_copy_reads_and_writes_at_hbm_bandwidth() -> None:
    model = napkin(0.5)
    block_bytes = 16 * NAPKIN_MODEL.bytes_per_token(1)
    assert model.copy_time_s(10) == pytest.approx(2 * 10 * block_bytes / 3.0e12)
    assert model.host_transfer_time_s(10) == pytest.approx(10 * block_bytes / 64e9)


def test_prefill_rate_is_tp_flops_over_two_p() -> None:
    model = napkin(0.6)
    assert model.prefill_tokens_per_s() == pytest.approx(480e12 / (2 * 70e9))


def test_roofline_rejects_bad_efficiencies_and_tp() -> None:
    with pytest.raises(ConfigError, match="mfu"):
        napkin(1.5)
    with pytest.raises(ConfigError, match="hbm_efficiency"):
        RooflineCostModel(NAPKIN_MODEL, NAPKIN_NODE, 1, hbm_efficiency=0.0)
    with pytest.raises(ConfigError, match="divide"):
        RooflineCostModel(resolve_geometry("llama-3-70b"), parse_node("8xh100"), 3)


def test_batch_shape_counts_decodes_chunks_context_and_causal_pairs() -> None:
    works = [
        SeqWork(0, [5], start_pos=99, block_table=[0] * 7),
        SeqWork(1, [1, 2, 3], start_pos=0, block_table=[1]),
        SeqWork(2, list(range(10)), start_pos=32, block_table=[2, 3, 4]),
    ]
    shape = batch_shape(works)
    assert shape == BatchShape(
        num_seqs=3,
        prefill_tokens=13,
        decode_seqs=1,
        kv_read_tokens=131,
        attention_pairs=100 + 6 + (10 * 32 + 55),
    )
    assert shape.new_tokens == 14
    assert shape_of(prefill_tokens=10, decode_seqs=1, context_tokens=32) == BatchShape(
        2, 10, 1, 64, 10 * 32 + 55 + 33
    )


def _profile(**overrides: object) -> StepProfile:
    data: dict[str, object] = {
        "model": "tiny",
        "device": "cpu",
        "dtype": "float32",
        "block_size": 16,
        "coefficients_s": (1e-3, 2e-5, 3e-4, 1e-7, 1e-9, 6e-8),
        "copy_block_s": 1e-5,
        "samples": 100,
        "r2": 0.99,
        "median_rel_error": 0.05,
    }
    data.update(overrides)
    return StepProfile(**data)  # type: ignore[arg-type]


def test_calibrated_model_is_linear_in_the_shape_features() -> None:
    model = CalibratedCostModel(_profile())
    shape = BatchShape(
        5,
        prefill_tokens=200,
        decode_seqs=4,
        kv_read_tokens=3000,
        attention_pairs=9e4,  # type: ignore[arg-type]
        shared_kv_tokens=1200,
    )
    expected = 1e-3 + 2e-5 * 200 + 3e-4 * 4 + 1e-7 * 3000 + 1e-9 * 9e4 + 6e-8 * 1800
    assert model.step_time_s(shape) == pytest.approx(expected)
    assert model.reads_distinct_kv
    assert model.step_time_s(BatchShape()) == 0.0
    assert model.copy_time_s(3) == pytest.approx(3e-5)
    assert model.prefill_tokens_per_s() == pytest.approx(1 / 2e-5)


def test_profile_round_trips_through_json(tmp_path) -> None:
    profile = _profile()
    path = tmp_path / "p.json"
    profile.save(path)
    data = json.loads(path.read_text())
    assert list(data["coefficients_s"]) == list(PROFILE_FEATURES)
    assert StepProfile.load(path) == profile


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(kind="other"), "not a kvpilot step profile"),
        (lambda d: d.update(version=99), "version"),
        (lambda d: d["coefficients_s"].pop("const"), "lacks"),
        (lambda d: d.pop("block_size"), "malformed"),
    ],
)
def test_bad_profiles_are_rejected_with_a_reason(tmp_path, mutate, message) -> None:
    data = _profile().to_json()
    data["coefficients_s"] = dict(data["coefficients_s"])  # type: ignore[arg-type]
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=message):
        StepProfile.load(path)


def test_a_version_1_profile_loads_without_the_distinct_kv_term_and_times_as_before(
    tmp_path,
) -> None:
    # Version 1 had five features; its fit never saw distinct KV: it loads with a zero
    # coefficient, gives the five-term times it always gave, and needs no distinct count.
    data = _profile().to_json()
    coeffs = dict(data["coefficients_s"])  # type: ignore[call-overload]
    del coeffs["distinct_kv_tokens"]
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({**data, "version": 1, "coefficients_s": coeffs}))
    old = StepProfile.load(path)
    assert old.coefficients_s == (1e-3, 2e-5, 3e-4, 1e-7, 1e-9, 0.0)
    model = CalibratedCostModel(old)
    assert not model.reads_distinct_kv
    shape = BatchShape(5, 200, 4, 3000, 90_000, shared_kv_tokens=1200)
    assert model.step_time_s(shape) == 1e-3 + 2e-5 * 200 + 3e-4 * 4 + 1e-7 * 3000 + 1e-9 * 90_000
    assert model.step_time_s(shape) == model.step_time_s(shape._replace(shared_kv_tokens=0))
    # A version 2 profile must carry the new coefficient.
    path.write_text(json.dumps({**data, "coefficients_s": coeffs}))
    with pytest.raises(ConfigError, match="distinct_kv_tokens"):
        StepProfile.load(path)


@st.composite
def shared_reads(draw: st.DrawFn) -> tuple[list[int], list[list[int]], int]:
    """Works' start positions and block tables drawn from a few block ids, so that some
    share blocks (whole or in part) and some do not."""
    block = draw(st.sampled_from([1, 4, 16]))
    ids = st.integers(0, 12)
    starts, tables = [], []
    for _ in range(draw(st.integers(0, 6))):
        start = draw(st.integers(0, 6 * block))
        table = draw(st.lists(ids, min_size=-(-start // block), max_size=-(-start // block) + 2))
        starts.append(start)
        tables.append(table)
    return starts, tables, block


@settings(deadline=None, max_examples=300)
@given(reads=shared_reads())
def test_shared_kv_is_the_kv_read_less_the_union_of_the_slots_read(
    reads: tuple[list[int], list[list[int]], int],
) -> None:
    starts, tables, block = reads
    slots = {
        (t[q // block], q % block) for s, t in zip(starts, tables, strict=True) for q in range(s)
    }
    assert shared_kv_tokens(starts, tables, block) == sum(starts) - len(slots)
    works = [SeqWork(i, [1], s, t) for i, (s, t) in enumerate(zip(starts, tables, strict=True))]
    shape = batch_shape(works, block_size=block)
    assert shape.distinct_kv_tokens == len(slots)
    assert shape._replace(shared_kv_tokens=0) == batch_shape(works)


def test_shared_kv_of_the_docstring_example() -> None:
    assert shared_kv_tokens([35, 49], [[7, 9, 4], [7, 9, 2, 5]], 16) == 32


@settings(deadline=None)
@given(
    heads=st.lists(st.integers(0, 5), min_size=1, max_size=12),
    tails=st.lists(st.integers(1, 70), min_size=12, max_size=12),
    block=st.sampled_from([4, 16]),
)
def test_a_calibrated_decode_run_with_shared_heads_times_each_step_to_the_last_bit(
    heads: list[int], tails: list[int], block: int
) -> None:
    # Sequence i reads a shared head of heads[i] whole blocks (ids 0..), then its own blocks
    # (ids from 100 * (i + 1)): each step writes its new token to its own blocks only.
    model = CalibratedCostModel(_profile())
    positions = [h * block + t for h, t in zip(heads, tails[: len(heads)], strict=True)]
    tables = [list(range(h)) + [100 * (i + 1) + j for j in range(200)] for i, h in enumerate(heads)]
    shared = shared_kv_tokens(positions, tables, block)
    assert shared == sum(h * block for h in heads) - max(heads) * block
    run = model.decode_run_s(positions, shared)
    clock = VirtualClock(0.0)
    durations, starts = [], [0.0]
    for step in range(40):
        works = [
            SeqWork(i, [1], p + step, t)
            for i, (p, t) in enumerate(zip(positions, tables, strict=True))
        ]
        shape = batch_shape(works, block_size=block)
        assert shape == decode_run_shape(positions, step, (), shared)
        assert next(run) == model.step_time_s(shape)
        clock.advance(model.step_time_s(shape))
        durations.append(model.step_time_s(shape))
        starts.append(clock.now())
    assert model.decode_run_clock(positions, 0.0, math.inf, 40, shared) == (durations, starts)


def test_unreadable_profile_names_the_file(tmp_path) -> None:
    path = tmp_path / "nope.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=r"nope\.json"):
        StepProfile.load(path)


GEMMA_LIKE = ModelGeometry(
    "gemma-like",
    42,
    8,
    256,
    9.24e9,
    "bf16",
    "bf16",
    3584,
    16,
    layer_groups=(LayerGroup(FULL, 21), LayerGroup(WINDOW, 21, window_tokens=4096)),
)


@settings(deadline=None)
@given(c=st.integers(1, 3000), p=st.integers(0, 9000), window=st.integers(1, 5000))
def test_window_pairs_count_what_each_query_sees(c: int, p: int, window: int) -> None:
    assert window_pairs(c, p, window) == sum(min(q + 1, window) for q in range(p, p + c))


def test_window_layers_read_at_most_their_window() -> None:
    hybrid = RooflineCostModel(GEMMA_LIKE, parse_node("h100"), 1, step_overhead_s=0.0)
    full = RooflineCostModel(
        dataclasses.replace(GEMMA_LIKE, layer_groups=()), parse_node("h100"), 1, step_overhead_s=0
    )
    assert hybrid.windows == (4096,)
    works = [SeqWork(i, [1], start_pos=60_000, block_table=[]) for i in range(32)]
    shape = batch_shape(works, hybrid.windows)
    assert shape.window_kv_read == (32 * 4096,) and shape.window_pairs == (32 * 4096,)
    cost = hybrid.cost(shape)
    # Half the layers read 60k tokens, half 4,096: a bit more than half the full model's KV.
    layer = GEMMA_LIKE.layer_bytes_per_token()
    assert cost.memory_bytes - GEMMA_LIKE.weight_bytes() == 21 * layer * 32 * (60_001 + 4097)
    assert hybrid.step_time_s(shape) == pytest.approx(cost.time_s)
    assert hybrid.step_time_s(shape) < 0.6 * full.step_time_s(batch_shape(works))
    # Below the window, the two agree.
    short = [SeqWork(i, [1], start_pos=1000, block_table=[]) for i in range(32)]
    assert hybrid.step_time_s(batch_shape(short, hybrid.windows)) == pytest.approx(
        full.step_time_s(batch_shape(short))
    )


@pytest.mark.parametrize(
    "model",
    [
        RooflineCostModel(GEMMA_LIKE, parse_node("h100"), 1),
        RooflineCostModel(resolve_geometry("llama-3-70b"), parse_node("8xh100"), 8),
        CalibratedCostModel(_profile()),
    ],
    ids=["roofline-hybrid", "roofline", "calibrated"],
)
@settings(deadline=None)
@given(positions=st.lists(st.integers(0, 9000), min_size=1, max_size=40))
def test_decode_run_durations_equal_each_steps_time_to_the_last_bit(
    model: Any, positions: list[int]
) -> None:
    run = model.decode_run_s(positions)
    for step in range(30):
        works = [
            SeqWork(i, [1], start_pos=p + step, block_table=[]) for i, p in enumerate(positions)
        ]
        shape = batch_shape(works, model.windows)
        assert shape == decode_run_shape(positions, step, model.windows)
        assert next(run) == model.step_time_s(shape)


@pytest.mark.parametrize(
    "model",
    [
        RooflineCostModel(GEMMA_LIKE, parse_node("h100"), 1),
        RooflineCostModel(resolve_geometry("llama-3-70b"), parse_node("8xh100"), 8),
        CalibratedCostModel(_profile()),
        # compute-bound for larger batches: the general loop as well as the memory-bound one
        RooflineCostModel(resolve_geometry("llama-3-8b"), parse_node("h100"), 1, mfu=0.02),
    ],
    ids=["roofline-hybrid", "roofline", "calibrated", "roofline-compute-bound"],
)
@settings(deadline=None)
@given(
    positions=st.lists(st.integers(0, 9000), min_size=1, max_size=40),
    start=st.floats(0.0, 1e5),
    span=st.floats(0.0, 2.0),
    max_steps=st.integers(1, 200),
)
def test_a_decode_runs_clock_is_the_clock_stepped_one_step_at_a_time(
    model: Any, positions: list[int], start: float, span: float, max_steps: int
) -> None:
    # Each step's duration as step_time_s gives it, added to a virtual clock step by step,
    # until max_steps steps or the first that ends at or after `until`: to the last bit.
    until = start + span
    clock = VirtualClock(start)
    durations, starts = [], [clock.now()]
    for step in range(max_steps):
        dt = model.step_time_s(decode_run_shape(positions, step, model.windows))
        clock.advance(dt)
        durations.append(dt)
        starts.append(clock.now())
        if clock.now() >= until:
            break
    assert model.decode_run_clock(positions, start, until, max_steps) == (durations, starts)
