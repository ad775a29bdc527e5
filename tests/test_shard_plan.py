"""`ShardPlan`: the ranks' slices tile every sharded dimension, each rank's query heads read
the KV heads it holds, and KV heads per rank are what the planner sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.errors import ConfigError
from kvpilot.model.config import ModelConfig
from kvpilot.model.parallel.plan import ShardPlan, check_degree
from kvpilot.sizing.geometry import ModelGeometry

HEAD_DIM = 8
HIDDEN = 32


def config(kv_heads: int, groups: int, inter: int, vocab: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        model_type="llama",
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=inter,
        num_layers=2,
        num_heads=kv_heads * groups,
        num_kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attention_bias=False,
        o_proj_bias=False,
        mlp_bias=False,
        qk_norm=False,
        sliding_window=None,
        sliding_layers=(False, False),
        eos_token_ids=(),
        bos_token_id=None,
        dtype="float32",
    )


def ranges(plans: list[ShardPlan], name: str) -> list[tuple[int, int]]:
    out = []
    for plan in plans:
        cut = plan.slice_for(name)
        assert cut is not None, name
        out.append(cut[1:])
    return out


def tiles(parts: list[tuple[int, int]], total: int) -> bool:
    """Consecutive, disjoint, covering [0, total)."""
    edges = [0] + [stop for _, stop in parts]
    return all(parts[i][0] == edges[i] for i in range(len(parts))) and edges[-1] == total


@settings(deadline=None, max_examples=150)
@given(
    kv_heads=st.sampled_from([1, 2, 4, 8]),
    groups=st.sampled_from([1, 2, 4]),
    degree=st.sampled_from([1, 2, 4, 8]),
    vocab=st.integers(8, 1000),
)
def test_slices_tile_and_query_heads_read_their_own_kv_heads(
    kv_heads: int, groups: int, degree: int, vocab: int
) -> None:
    cfg = config(kv_heads, groups, inter=8 * 16, vocab=vocab)
    try:
        check_degree(cfg, degree)
    except ConfigError:
        assert cfg.num_heads % degree or (kv_heads % degree and degree % kv_heads)
        return
    plans = [ShardPlan(cfg, rank, degree) for rank in range(degree)]
    d = HEAD_DIM
    assert tiles(ranges(plans, "model.layers.0.self_attn.q_proj.weight"), cfg.num_heads * d)
    assert tiles(ranges(plans, "model.layers.0.self_attn.o_proj.weight"), cfg.num_heads * d)
    assert tiles(ranges(plans, "model.layers.1.mlp.up_proj.weight"), cfg.intermediate_size)
    assert tiles(ranges(plans, "model.layers.1.mlp.down_proj.weight"), cfg.intermediate_size)
    assert tiles(ranges(plans, "model.embed_tokens.weight"), vocab)
    assert tiles(ranges(plans, "lm_head.weight"), vocab)
    held: set[int] = set()
    geometry = ModelGeometry(
        "m", 2, kv_heads, d, 1e6, "bfloat16", "bfloat16", HIDDEN, cfg.num_heads
    )
    for plan in plans:
        assert plan.kv_heads == geometry.kv_heads_per_device(degree)  # the planner's sizing
        kv = range(plan.first_kv_head, plan.first_kv_head + plan.kv_heads)
        held |= set(kv)
        start, stop = ranges([plan], "model.layers.0.self_attn.k_proj.weight")[0]
        assert (start, stop) == (kv.start * d, kv.stop * d)
        for q in range(plan.rank * plan.heads, (plan.rank + 1) * plan.heads):
            assert q // (cfg.num_heads // kv_heads) in kv  # GQA: query head q reads KV head q // g
        local = plan.local_config()
        assert (local.num_heads, local.num_kv_heads) == (plan.heads, plan.kv_heads)
    assert held == set(range(kv_heads))
    assert plans[0].slice_for("model.layers.0.input_layernorm.weight") is None
    assert [p.zeroed("model.layers.0.mlp.down_proj.bias") for p in plans] == [
        r != 0 for r in range(degree)
    ]


def test_a_degree_that_splits_no_head_evenly_is_refused_with_the_degrees_that_work() -> None:
    with pytest.raises(ConfigError, match=r"use one of \[1, 2, 4, 8\]"):
        check_degree(config(kv_heads=4, groups=2, inter=64, vocab=100), 3)
