from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.errors import ConfigError
from kvpilot.policy.breakeven import PauseAction
from kvpilot.sizing.capacity import block_sizing, max_concurrency, memory_budget
from kvpilot.sizing.geometry import PRESETS
from kvpilot.sizing.hardware import ACCELERATORS, GIB, parse_node
from kvpilot.sizing.plan import PlanConfig, make_plan

LLAMA_70B = PRESETS["llama-3-70b"]
KIB = 1024


def napkin_0_7_config(**changes: object) -> PlanConfig:
    """8xH100 with 80e9-byte devices, 140 GB of weights and 4.5 GB reserve per device."""
    fields: dict[str, object] = {
        "geometry": LLAMA_70B,
        "node": parse_node("8xh100").with_overrides(hbm_bytes=80 * 10**9),
        "tp": 8,
        "weight_bytes": 140e9,
        "reserve_bytes_per_device": 4.5e9,
        "headroom": 0.10,
    }
    fields.update(changes)
    return PlanConfig(**fields)  # type: ignore[arg-type]


def test_node_parses_count_and_accelerator() -> None:
    node = parse_node("8xh100")
    assert (node.count, node.accelerator.name) == (8, "h100-sxm")
    assert parse_node("h200").count == 1
    assert parse_node("8xh100-sxm").accelerator is ACCELERATORS["h100-sxm"]
    assert parse_node("4XB200").name == "4xb200"


def test_unknown_accelerator_lists_the_presets() -> None:
    with pytest.raises(ConfigError, match="a100-40, a100-80, h100-pcie, h100-sxm, h200"):
        parse_node("8xtpu-v5")


def test_node_figures_can_be_overridden() -> None:
    node = parse_node("8xh100").with_overrides(host_link_bw_bytes_s=32e9, nvme_bw_bytes_s=14e9)
    assert node.host_link_bw_bytes_s == 8 * 32e9
    assert node.nvme_bw_bytes_s == 14e9
    assert node.accelerator.hbm_bytes == 80 * GIB


def test_grace_hosted_parts_reach_host_memory_over_nvlink_c2c() -> None:
    # 900 GB/s both directions together: 450 GB/s each way, as a copy moves.
    for name in ("gh200", "gb200"):
        assert ACCELERATORS[name].host_link_bw_bytes_s == 450e9
        assert ACCELERATORS[name].host_link == "NVLink-C2C"


def test_napkin_0_1_pool_is_526_gb_on_a_687_gb_node() -> None:
    budget = memory_budget(LLAMA_70B, parse_node("8xh100"), tp=8, reserve_bytes_per_device=2.5e9)
    assert round(budget.hbm_bytes_node / 1e9, 1) == 687.2
    assert round(budget.weight_bytes_node / 1e9, 1) == 141.2
    assert round(budget.reserve_bytes_node / 1e9, 1) == 20.0
    assert round(budget.pool_bytes_node / 1e9, 1) == 526.0


def test_napkin_0_1_node_holds_195_48_12_trajectories() -> None:
    plan = make_plan(PlanConfig(LLAMA_70B, parse_node("8xh100"), tp=8))
    assert [r.cold for r in plan.capacity] == [195, 48, 12]
    assert [round(r.trajectory_bytes / 1e9, 1) for r in plan.capacity] == [2.7, 10.7, 42.9]
    assert plan.footprint.model_bytes == 327_680


def test_napkin_0_3_block_sizing_on_a_60_gib_pool() -> None:
    plan = make_plan(
        PlanConfig(
            LLAMA_70B,
            parse_node("8xh100"),
            tp=8,
            weight_bytes=140 * GIB,
            reserve_bytes_per_device=2.5 * GIB,
            block_sizes=(16, 64),
        )
    )
    assert plan.budget.pool_bytes_per_device == 60 * GIB
    assert plan.footprint.device_bytes == 40 * KIB
    b16, b64 = plan.blocks
    assert b16.block_bytes == 640 * KIB
    assert b16.num_blocks == 98_304
    assert b16.token_capacity == 1_572_864
    assert b16.tail_waste_bytes == 75 * 1024 * KIB
    assert round(b16.tail_waste_fraction * 100, 2) == 0.12
    assert b64.block_bytes == 2560 * KIB
    assert round(b64.tail_waste_fraction * 100, 2) == 0.51


def test_napkin_0_7_cold_and_shared_concurrency() -> None:
    plan = make_plan(napkin_0_7_config(contexts=(32768,), output_tokens=2048, shared_tokens=24576))
    assert plan.budget.pool_bytes_node == pytest.approx(464e9)
    (row,) = plan.capacity
    assert (row.cold, row.shared) == (36, 122)
    assert row.shared / row.cold == pytest.approx(3.38, abs=0.02)


def test_table_7_cold_column_for_8xh100() -> None:
    plan = make_plan(napkin_0_7_config(contexts=(8192, 32768, 65536, 131072)))
    assert [r.cold for r in plan.capacity] == [155, 38, 19, 9]


def test_shared_prefix_longer_than_context_has_no_sharing_figure() -> None:
    assert max_concurrency(526e9, 327_680, 8192, shared_tokens=24576) is None
    assert max_concurrency(526e9, 327_680, 24576, shared_tokens=24576) is None


def test_shared_prefix_held_once_raises_concurrency() -> None:
    cold = max_concurrency(464e9, 327_680, 32768, 2048, headroom=0.1)
    shared = max_concurrency(464e9, 327_680, 32768, 2048, shared_tokens=24576, headroom=0.1)
    assert cold is not None and shared is not None
    assert shared > cold


def test_replicas_multiply_concurrency() -> None:
    geometry = PRESETS["llama-3-8b"]
    one = make_plan(PlanConfig(geometry, parse_node("2xh100"), tp=2, shared_tokens=0))
    two = make_plan(PlanConfig(geometry, parse_node("4xh100"), tp=2, shared_tokens=0))
    assert two.budget.replicas == 2
    assert [r.cold for r in two.capacity] == [2 * r.cold for r in one.capacity]


def test_tp_must_divide_the_node() -> None:
    with pytest.raises(ConfigError, match="must divide the 8 accelerators"):
        make_plan(PlanConfig(LLAMA_70B, parse_node("8xh100"), tp=3))


def test_weights_that_fill_the_device_are_an_actionable_error() -> None:
    with pytest.raises(ConfigError, match="raise --tp, lower --weights-dtype or use a bigger"):
        make_plan(PlanConfig(LLAMA_70B, parse_node("1xh100")))


def test_headroom_must_be_a_fraction_below_one() -> None:
    with pytest.raises(ConfigError, match="headroom"):
        PlanConfig(LLAMA_70B, parse_node("8xh100"), headroom=1.0)


def test_napkin_0_6_pause_is_priced_for_each_context() -> None:
    plan = make_plan(PlanConfig(LLAMA_70B, parse_node("8xh100"), tp=8, pause_s=45))
    row = next(r for r in plan.pauses if r.context_tokens == 32768)
    d = row.decision
    assert d.action is PauseAction.OFFLOAD_HOST
    assert d.reload_s * 1e3 == pytest.approx(21, abs=0.5)
    assert d.recompute_s == pytest.approx(1.3, abs=0.01)
    assert d.reload_vs_recompute == pytest.approx(62, abs=0.5)
    assert d.held_gb_s == pytest.approx(483, abs=1)


def test_no_pause_means_no_pause_rows() -> None:
    assert make_plan(PlanConfig(LLAMA_70B, parse_node("8xh100"))).pauses == ()


def test_block_tail_waste_grows_with_block_size() -> None:
    small = block_sizing(60 * GIB, 40 * KIB, 16, 256)
    large = block_sizing(60 * GIB, 40 * KIB, 64, 256)
    assert small.tail_waste_tokens_per_seq == 7.5
    assert large.tail_waste_tokens_per_seq == 31.5
    assert small.tail_waste_fraction < large.tail_waste_fraction


@given(
    pool=st.floats(1e9, 2e12),
    bpt=st.integers(1024, 1 << 20),
    context=st.integers(1, 1 << 18),
    extra=st.integers(1, 1 << 16),
    output=st.integers(0, 1 << 14),
    headroom=st.floats(0.0, 0.5),
)
def test_concurrency_never_rises_with_longer_contexts(
    pool: float, bpt: int, context: int, extra: int, output: int, headroom: float
) -> None:
    short = max_concurrency(pool, bpt, context, output, headroom=headroom)
    long = max_concurrency(pool, bpt, context + extra, output, headroom=headroom)
    assert short is not None and long is not None
    assert long <= short
    assert short * (context + output) * bpt <= pool * (1 - headroom) * (1 + 1e-9)


@given(
    context=st.integers(1, 1 << 17),
    shared_share=st.floats(0.0, 1.0),
    output=st.integers(1, 4096),
)
def test_sharing_a_prefix_never_lowers_concurrency(
    context: int, shared_share: float, output: int
) -> None:
    shared = int(context * shared_share)
    cold = max_concurrency(464e9, 327_680, context, output, headroom=0.1)
    warm = max_concurrency(464e9, 327_680, context, output, shared, headroom=0.1)
    assert cold is not None and warm is not None
    assert warm >= cold
