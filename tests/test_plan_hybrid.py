"""Hybrid attention in the planner: sliding-window layers hold at most their window.

Every figure below is worked by hand from the config written in this file (the fields of
the published Hugging Face config.json; nothing is downloaded).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.errors import ConfigError
from kvpilot.sizing.capacity import trajectory_concurrency
from kvpilot.sizing.geometry import ModelGeometry, from_hf_config, resolve_geometry
from kvpilot.sizing.hardware import GIB, parse_node
from kvpilot.sizing.layers import FULL, STATE, WINDOW, LayerGroup, layer_groups_from_config
from kvpilot.sizing.plan import PlanConfig, make_plan

H100 = 80 * GIB  # 85,899,345,920 bytes
H200 = 141 * GIB  # 151,397,597,184 bytes

GEMMA_2_9B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "num_attention_heads": 16,
    "num_hidden_layers": 42,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "vocab_size": 256000,
    "sliding_window": 4096,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}

# Qwen3-8B's shape with three sliding layers for every full one (layer_types mixes them).
QWEN3_MIXED: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "sliding_window": 4096,
    "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 9,
    "torch_dtype": "bfloat16",
}

MISTRAL_7B_V01: dict[str, Any] = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "sliding_window": 4096,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def geometry_of(tmp_path: Path, name: str, config: dict[str, Any]) -> ModelGeometry:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return from_hf_config(folder)


def test_gemma_2_alternates_window_and_full_layers(tmp_path: Path) -> None:
    g = geometry_of(tmp_path, "gemma-2-9b", GEMMA_2_9B)
    assert g.groups == (LayerGroup(FULL, 21), LayerGroup(WINDOW, 21, window_tokens=4096))
    assert g.layer_bytes_per_token() == 2 * 8 * 256 * 2 == 8192
    assert g.bytes_per_token() == 344_064  # equation 1, every layer
    assert g.full_bytes_per_token() == 172_032
    # 8k tokens: 21 layers x 8,192 tokens + 21 layers x 4,096 tokens, 8 KiB each.
    assert g.kv_bytes(8192) == 2_113_929_216
    assert 8192 * g.bytes_per_token() / g.kv_bytes(8192) == pytest.approx(4 / 3)
    assert g.max_context_tokens == 8192


def test_gemma_2_ties_its_embeddings_without_saying_so(tmp_path: Path) -> None:
    # Gemma's config class ties the LM head by default; config.json omits the key.
    g = geometry_of(tmp_path, "gemma-2-9b", GEMMA_2_9B)
    # 256,000 x 3,584 embeddings once + 42 x (44,040,192 attention + 154,140,672 MLP
    # + 4 norms of 3,584) + the final norm.
    assert g.num_params == 9_241_705_984


def test_gemma_2_plan_on_one_h100(tmp_path: Path) -> None:
    g = geometry_of(tmp_path, "gemma-2-9b", GEMMA_2_9B)
    plan = make_plan(
        PlanConfig(g, parse_node("1xh100"), contexts=(8192, 32768), shared_tokens=2048)
    )
    pool = H100 - 18_483_411_968 - 2.5e9  # HBM - bf16 weights - reserve = 64,915,933,952
    assert plan.budget.pool_bytes_per_device == pytest.approx(pool)
    (row,) = plan.capacity  # 32,768 is past the model's limit: clamped to 8,192, one row
    assert row.context_tokens == 8192
    assert row.trajectory_bytes == 2_113_929_216
    assert row.cold == 30  # 64.92e9 / 2.114e9 = 30.7 (equation 1 alone would say 23)
    # Shared 2,048: full layers hold it once; the window layers' last 4,096 tokens are
    # all past it, so private = 21 x 6,144 + 21 x 4,096 tokens of 8 KiB.
    assert row.shared == (int(pool) - 21 * 2048 * 8192) // (21 * 10240 * 8192) == 36
    assert any("32,768 exceeds gemma-2-9b's limit of 8,192" in w for w in plan.warnings)
    assert plan.footprint.window_cap_model_bytes == 21 * 4096 * 8192


def test_float32_config_plans_fp32_kv_out_loud(tmp_path: Path) -> None:
    g = geometry_of(tmp_path, "gemma-2-9b", {**GEMMA_2_9B, "torch_dtype": "float32"})
    assert g.kv_dtype == "fp32" and g.layer_bytes_per_token() == 16384
    plan = make_plan(PlanConfig(g, parse_node("1xh200"), contexts=(8192,)))
    assert any("KV cache in fp32" in w and "--kv-dtype bf16" in w for w in plan.warnings)
    bf16 = make_plan(
        PlanConfig(resolve_geometry(tmp_path / "gemma-2-9b", "bf16"), parse_node("1xh200"))
    )
    assert not any("KV cache in fp32" in w for w in bf16.warnings)


def test_qwen3_mixed_layer_types_at_128k_on_one_h200(tmp_path: Path) -> None:
    g = geometry_of(tmp_path, "qwen3-mixed", QWEN3_MIXED)
    assert g.groups == (LayerGroup(FULL, 9), LayerGroup(WINDOW, 27, window_tokens=4096))
    assert g.bytes_per_token() == 36 * 4096 == 147_456
    assert g.full_bytes_per_token() == 9 * 4096 == 36_864
    # 9 x 131,072 + 27 x 4,096 tokens of 4 KiB each.
    assert g.kv_bytes(131072) == 5_284_823_040
    assert g.num_params == 8_190_735_360
    plan = make_plan(PlanConfig(g, parse_node("1xh200"), contexts=(131072,), shared_tokens=0, tp=1))
    pool = H200 - 2 * 8_190_735_360 - 2.5e9  # 132,516,126,464
    assert plan.budget.pool_bytes_per_device == pytest.approx(pool)
    assert plan.capacity[0].cold == 25  # equation 1 alone: 19.3 GB each, 6
    assert int(pool // (131072 * 147_456)) == 6


def test_qwen_use_sliding_window_windows_the_layers_past_max_window_layers() -> None:
    cfg = {**QWEN3_MIXED, "use_sliding_window": True, "max_window_layers": 28}
    del cfg["layer_types"]
    groups = layer_groups_from_config(cfg, 36)
    assert groups == (LayerGroup(FULL, 28), LayerGroup(WINDOW, 8, window_tokens=4096))
    # Qwen2.5 configs carry a sliding_window but leave use_sliding_window false: full.
    assert layer_groups_from_config({**cfg, "use_sliding_window": False}, 36) == (
        LayerGroup(FULL, 36),
    )


def test_mistral_sliding_window_caps_every_layer(tmp_path: Path) -> None:
    g = geometry_of(tmp_path, "mistral-7b-v0.1", MISTRAL_7B_V01)
    assert g.groups == (LayerGroup(WINDOW, 32, window_tokens=4096),)
    assert g.full_bytes_per_token() == 0
    assert g.kv_bytes(32768) == 32 * 4096 * 4096 == 536_870_912  # 1/8 of equation 1
    assert g.kv_bytes(1000) == 1000 * g.bytes_per_token()
    assert g.num_params == 7_241_732_096
    plan = make_plan(PlanConfig(g, parse_node("1xh100"), contexts=(32768,)))
    pool = H100 - 2 * 7_241_732_096 - 2.5e9  # 68,915,881,728
    row = plan.capacity[0]
    assert row.cold == 128  # 68.9e9 / 536.9e6 = 128.4
    # A 24,576-token prefix lies wholly outside every sequence's last 4,096 tokens.
    assert row.shared == row.cold
    assert int(pool // (32768 * 131_072)) == 16


def test_a_prefix_inside_the_window_is_shared_by_window_layers() -> None:
    g = ModelGeometry(
        "w", 2, 1, 64, 1e9, "bf16", "bf16", 64, 1, layer_groups=(LayerGroup(WINDOW, 2, 4096),)
    )
    per_layer = g.layer_bytes_per_token()
    # 6,000 tokens keep their last 4,096; 2,096 of those are inside a 4,000-token prefix.
    assert g.shared_and_private_bytes(6000, 4000) == (2 * 2096 * per_layer, 2 * 2000 * per_layer)


def test_linear_attention_layers_hold_a_fixed_state(tmp_path: Path) -> None:
    cfg = {
        **QWEN3_MIXED,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 9,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    }
    g = geometry_of(tmp_path, "qwen3-next-like", cfg)
    conv = 3 * (2 * 16 * 128 + 32 * 128)  # (kernel - 1) x conv_dim
    recurrent = 32 * 128 * 128
    assert g.groups == (LayerGroup(FULL, 9), LayerGroup(STATE, 27, state_elems=conv + recurrent))
    assert g.bytes_per_token() == 9 * 4096  # linear layers keep no per-token KV
    assert g.kv_bytes(100) == 100 * 9 * 4096 + 27 * (conv + recurrent) * 2
    assert g.kv_bytes(0) == g.state_bytes_per_seq() > 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": ["full_attention"] * 3}, "one type for each of the 36 layers"),
        ({"layer_types": ["mamba"] * 36}, "layer 0 has type 'mamba'"),
        ({"sliding_window": None}, "sliding_attention layers need a sliding_window"),
        ({"layer_types": ["linear_attention"] * 36}, "linear_num_key_heads"),
    ],
)
def test_unknown_or_incomplete_layer_types_are_config_errors(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        geometry_of(tmp_path, "bad", {**QWEN3_MIXED, **change})


def test_default_tp_is_the_smallest_that_fits_with_replicas_filling_the_node() -> None:
    small = make_plan(PlanConfig(resolve_geometry("qwen2.5-7b"), parse_node("8xh100")))
    assert (small.budget.tp, small.budget.replicas) == (1, 8)
    assert "smallest" in small.tp_reason
    big = make_plan(PlanConfig(resolve_geometry("llama-3-70b"), parse_node("8xh100")))
    # TP 2 leaves 25.6 GB per group: too little for one 131,072-token sequence (42.9 GB).
    assert (big.budget.tp, big.budget.replicas) == (4, 2)
    given_tp = make_plan(PlanConfig(resolve_geometry("llama-3-70b"), parse_node("8xh100"), tp=8))
    assert given_tp.tp_reason == "TP 8: given"


def test_weights_dtype_changes_what_fits() -> None:
    fp8 = resolve_geometry("llama-3-70b", weight_dtype="fp8")
    assert fp8.weight_bytes() == pytest.approx(70.6e9)
    plan = make_plan(PlanConfig(fp8, parse_node("8xh100")))
    assert plan.budget.tp == 2
    int4 = resolve_geometry("llama-3-70b", weight_dtype="int4")
    assert int4.weight_bytes() == pytest.approx(35.3e9)
    with pytest.raises(ConfigError, match="unknown weights dtype 'int3'"):
        resolve_geometry("llama-3-70b", weight_dtype="int3")
    with pytest.raises(ConfigError, match="unknown KV dtype 'int4'"):
        resolve_geometry("llama-3-70b", kv_dtype="int4")


layer_group = st.one_of(
    st.builds(LayerGroup, st.just(FULL), st.integers(1, 20)),
    st.builds(
        LayerGroup, st.just(WINDOW), st.integers(1, 20), window_tokens=st.integers(1, 1 << 14)
    ),
)


@settings(deadline=None)
@given(
    groups=st.lists(layer_group, min_size=1, max_size=4),
    tokens=st.integers(1, 1 << 18),
    shared_share=st.floats(0.0, 1.0),
    tp=st.sampled_from([1, 2, 4, 8]),
)
def test_layer_by_layer_kv_never_exceeds_equation_1_and_splits_exactly(
    groups: list[LayerGroup], tokens: int, shared_share: float, tp: int
) -> None:
    layers = sum(g.num_layers for g in groups)
    g = ModelGeometry(
        "h", layers, 8, 128, 1e9, "bf16", "bf16", 1024, 16, layer_groups=tuple(groups)
    )
    kv = g.kv_bytes(tokens, tp)
    assert kv <= tokens * g.bytes_per_token(tp)
    assert (kv == tokens * g.bytes_per_token(tp)) == all(
        grp.kind == FULL or (grp.window_tokens or 0) >= tokens for grp in groups
    )
    assert g.kv_bytes(tokens + 1, tp) >= kv
    shared_tokens = int(tokens * shared_share)
    shared, private = g.shared_and_private_bytes(tokens, shared_tokens, tp)
    assert shared + private == kv
    assert shared <= shared_tokens * g.bytes_per_token(tp)
    cold = trajectory_concurrency(g, 1e12, tp, tokens)
    uniform = int(1e12 // (tokens * g.group_bytes_per_token(tp)))
    assert cold is not None and cold >= uniform
