from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.errors import ConfigError
from kvpilot.sizing.geometry import PRESETS, ModelGeometry, from_hf_config, resolve_geometry

# Published Hugging Face configs (the fields sizing reads).
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "llama-3-70b": {
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-8b": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "mistral-7b": {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_attention_heads": 128,
        "num_hidden_layers": 61,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
    },
}


def write_config(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_llama_3_70b_caches_327680_bytes_per_token() -> None:
    assert PRESETS["llama-3-70b"].bytes_per_token() == 327_680


def test_tensor_parallelism_splits_kv_heads_across_devices() -> None:
    assert PRESETS["llama-3-70b"].bytes_per_token(tp=8) == 40_960
    assert PRESETS["llama-3-70b"].bytes_per_token(tp=2) == 163_840


def test_tensor_parallelism_beyond_kv_heads_replicates_them() -> None:
    qwen = PRESETS["qwen2.5-7b"]  # 4 KV heads
    assert qwen.bytes_per_token(tp=8) == 2 * 28 * 1 * 128 * 2
    assert qwen.group_bytes_per_token(tp=8) == 2 * qwen.bytes_per_token()


def test_tensor_parallelism_that_neither_divides_nor_covers_heads_is_rejected() -> None:
    with pytest.raises(ConfigError, match="tensor parallel degree 3"):
        PRESETS["llama-3-70b"].bytes_per_token(tp=3)


def test_mla_caches_one_latent_per_layer_replicated_per_device() -> None:
    deepseek = PRESETS["deepseek-v3"]
    assert deepseek.bytes_per_token() == 61 * (512 + 64) * 2
    assert deepseek.bytes_per_token(tp=8) == deepseek.bytes_per_token()
    assert deepseek.group_bytes_per_token(tp=8) == 8 * deepseek.bytes_per_token()


def test_trajectory_footprints_match_napkin_math_0_1() -> None:
    llama = PRESETS["llama-3-70b"]
    gb = [round(llama.kv_bytes(s) / 1e9, 1) for s in (8192, 32768, 131072)]
    assert gb == [2.7, 10.7, 42.9]


def test_weights_split_across_tensor_parallel_devices() -> None:
    llama = PRESETS["llama-3-70b"]
    assert llama.weight_bytes() == pytest.approx(141.2e9)
    assert llama.weight_bytes(tp=8) == pytest.approx(17.65e9)


def test_fp8_kv_cache_halves_bytes_per_token() -> None:
    fp8 = resolve_geometry("llama-3-70b", kv_dtype="fp8")
    assert fp8.kv_dtype == "fp8"
    assert fp8.bytes_per_token() == 163_840
    assert fp8.weight_dtype == "bf16"


def test_dtype_spellings_are_normalised() -> None:
    assert resolve_geometry("mistral-7b", kv_dtype="float16").kv_dtype == "fp16"
    assert resolve_geometry("mistral-7b", kv_dtype="torch.bfloat16").kv_dtype == "bf16"


def test_unknown_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="bf16, fp16, fp32, fp8"):
        resolve_geometry("mistral-7b", kv_dtype="int3")


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_geometry("gpt-5")
    for name in PRESETS:
        assert name in str(info.value)


def test_preset_names_are_case_insensitive() -> None:
    assert resolve_geometry("Llama-3-70B") is PRESETS["llama-3-70b"]


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_config_json_gives_the_preset_geometry(tmp_path: Path, name: str) -> None:
    geometry = from_hf_config(write_config(tmp_path / name, HF_CONFIGS[name]))
    preset = PRESETS[name]
    assert geometry.bytes_per_token() == preset.bytes_per_token()
    assert geometry.weight_dtype == preset.weight_dtype
    assert geometry.num_params == pytest.approx(preset.num_params, rel=0.01)


def test_moe_config_counts_active_parameters_for_prefill(tmp_path: Path) -> None:
    geometry = from_hf_config(write_config(tmp_path / "dsv3", HF_CONFIGS["deepseek-v3"]))
    assert geometry.num_active_params == pytest.approx(37e9, rel=0.03)
    assert geometry.flops_params == geometry.num_active_params


def test_config_folder_is_read_like_its_config_json(tmp_path: Path) -> None:
    write_config(tmp_path / "my-llama", HF_CONFIGS["llama-3-8b"])
    geometry = resolve_geometry(tmp_path / "my-llama")
    assert geometry.name == "my-llama"
    assert geometry.bytes_per_token() == 131_072


def test_missing_kv_heads_and_head_dim_default_to_multi_head(tmp_path: Path) -> None:
    config = {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12}
    geometry = from_hf_config(write_config(tmp_path, config))
    assert geometry.num_kv_heads == 12
    assert geometry.head_dim == 64
    assert geometry.bytes_per_token() == 2 * 12 * 12 * 64 * 2


def test_transformers_5_dtype_key_is_read(tmp_path: Path) -> None:
    config = {**HF_CONFIGS["mistral-7b"], "dtype": "float16"}
    del config["torch_dtype"]
    assert from_hf_config(write_config(tmp_path, config)).kv_dtype == "fp16"


def test_tied_embeddings_are_counted_once(tmp_path: Path) -> None:
    untied = from_hf_config(write_config(tmp_path / "a", HF_CONFIGS["llama-3-8b"]))
    tied = from_hf_config(
        write_config(tmp_path / "b", {**HF_CONFIGS["llama-3-8b"], "tie_word_embeddings": True})
    )
    assert untied.num_params - tied.num_params == 128256 * 4096


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "cannot read"),
        ("[1, 2]", "not a JSON object"),
        (json.dumps({"hidden_size": 4096, "num_attention_heads": 32}), "num_hidden_layers"),
        (
            json.dumps({"num_hidden_layers": "32", "hidden_size": 4096, "num_attention_heads": 32}),
            "positive integer",
        ),
    ],
)
def test_malformed_config_is_a_config_error(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        from_hf_config(path)


def test_folder_without_config_json_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        from_hf_config(tmp_path)


def test_mla_needs_both_latent_dimensions() -> None:
    with pytest.raises(ConfigError, match="both kv_lora_rank and qk_rope_head_dim"):
        ModelGeometry("x", 2, 2, 64, 1e9, "bf16", "bf16", 128, 2, kv_lora_rank=64)


@given(
    layers=st.integers(1, 128),
    kv_heads=st.sampled_from([1, 2, 4, 8, 16]),
    head_dim=st.sampled_from([64, 96, 128, 256]),
    tp=st.sampled_from([1, 2, 4, 8, 16]),
    dtype=st.sampled_from(["bf16", "fp16", "fp32", "fp8"]),
    tokens=st.integers(0, 1 << 20),
)
def test_tp_group_holds_at_least_the_whole_model_and_exactly_when_heads_split(
    layers: int, kv_heads: int, head_dim: int, tp: int, dtype: str, tokens: int
) -> None:
    g = ModelGeometry("g", layers, kv_heads, head_dim, 1e9, "bf16", dtype, 1024, 16)
    assert g.group_bytes_per_token(tp) >= g.bytes_per_token()
    assert (g.group_bytes_per_token(tp) == g.bytes_per_token()) == (tp <= kv_heads)
    assert g.kv_bytes(tokens, tp) == tokens * g.bytes_per_token(tp)


def test_malformed_config_given_by_path_also_suggests_the_presets(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{}")
    with pytest.raises(ConfigError, match=r"num_hidden_layers.*llama-3-70b"):
        resolve_geometry(path)


def test_mla_config_reads_the_latent_dimensions(tmp_path: Path) -> None:
    geometry = from_hf_config(write_config(tmp_path, HF_CONFIGS["deepseek-v3"]))
    assert (geometry.kv_lora_rank, geometry.qk_rope_head_dim) == (512, 64)
    assert geometry.head_dim == PRESETS["deepseek-v3"].head_dim
