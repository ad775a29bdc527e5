"""ModelConfig from config.json, RoPE frequencies, and loading errors users can act on."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.errors import ModelLoadError, UnsupportedArchitecture
from kvpilot.model.config import ModelConfig, RopeScaling
from kvpilot.model.kv_cache import kv_bytes_per_block
from kvpilot.model.loader import resolve_model_path
from kvpilot.model.rope import RopeTable, apply_rope, inverse_frequencies
from kvpilot.model.runner import ModelRunner


def _raw(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def _write(folder: Path, raw: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def _copy_checkpoint(src: Path, dst: Path, **changes: Any) -> Path:
    dst.mkdir(parents=True)
    for item in src.iterdir():
        (dst / item.name).write_bytes(item.read_bytes())
    return _write(dst, {**_raw(src), **changes})


def test_llama_config_reads_geometry_and_llama3_rope(hf_checkpoint: Callable[[str], Path]) -> None:
    config = ModelConfig.from_folder(hf_checkpoint("llama"))
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        2,
        4,
        2,
        16,
    )
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (64, 128, 300)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert config.eos_token_ids == (256, 261)
    assert not config.tie_word_embeddings
    assert config.sliding_window is None and not config.qk_norm and not config.attention_bias


def test_pre_v5_config_with_top_level_rope_theta_and_rope_scaling_is_read() -> None:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "max_position_embeddings": 4096,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    config = ModelConfig.from_dict(raw)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert config.head_dim == 16
    assert config.eos_token_ids == (2,)
    assert config.dtype == "bfloat16"


def test_qwen2_has_qkv_bias_but_no_output_bias(hf_checkpoint: Callable[[str], Path]) -> None:
    config = ModelConfig.from_folder(hf_checkpoint("qwen2"))
    assert config.attention_bias and not config.o_proj_bias
    assert config.tie_word_embeddings


def test_qwen3_reads_explicit_head_dim_and_uses_qk_norm(
    hf_checkpoint: Callable[[str], Path],
) -> None:
    config = ModelConfig.from_folder(hf_checkpoint("qwen3"))
    assert config.head_dim == 32 != config.hidden_size // config.num_heads
    assert config.qk_norm


def test_mistral_sliding_window_covers_every_layer(hf_checkpoint: Callable[[str], Path]) -> None:
    config = ModelConfig.from_folder(hf_checkpoint("mistral"))
    assert config.sliding_window == 48
    assert [config.layer_window(i) for i in range(config.num_layers)] == [48, 48]


def test_qwen_sliding_window_applies_only_when_enabled_and_per_layer_type(
    hf_checkpoint: Callable[[str], Path],
) -> None:
    raw = _raw(hf_checkpoint("qwen2"))
    assert ModelConfig.from_dict({**raw, "sliding_window": 16}).sliding_window is None
    enabled = ModelConfig.from_dict(
        {
            **raw,
            "use_sliding_window": True,
            "sliding_window": 16,
            "layer_types": ["full_attention", "sliding_attention"],
        }
    )
    assert [enabled.layer_window(i) for i in range(2)] == [None, 16]


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_inverse_frequencies_equal_transformers(rope: dict[str, Any]) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = LlamaConfig(
        hidden_size=128, num_attention_heads=4, num_hidden_layers=1, rope_parameters=dict(rope)
    )
    ours = ModelConfig.from_dict({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    assert torch.equal(inverse_frequencies(ours), LlamaRotaryEmbedding(hf).inv_freq)


def test_rotation_equals_transformers_apply_rotary_pos_emb(
    hf_checkpoint: Callable[[str], Path],
) -> None:
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    path = hf_checkpoint("llama")
    table = RopeTable(ModelConfig.from_folder(path), torch.device("cpu"), torch.float32, 2048)
    table.ensure(300)
    positions = torch.tensor([0, 1, 7, 63, 64, 299])
    x = torch.randn(6, 3, 16, generator=torch.Generator().manual_seed(0))
    cos, sin = LlamaRotaryEmbedding(AutoConfig.from_pretrained(path))(x, positions[None])
    expected, _ = apply_rotary_pos_emb(x[None].transpose(1, 2), x[None].transpose(1, 2), cos, sin)
    ours = apply_rope(x, *table.lookup(positions))
    assert torch.equal(ours, expected[0].transpose(0, 1))


def test_kv_bytes_per_block_is_2_L_Hkv_B_d_b(hf_checkpoint: Callable[[str], Path]) -> None:
    config = ModelConfig.from_folder(hf_checkpoint("qwen3"))
    assert kv_bytes_per_block(config, 16, torch.bfloat16) == 2 * 2 * 2 * 16 * 32 * 2
    assert kv_bytes_per_block(config, 16, torch.float32) == 2 * 2 * 2 * 16 * 32 * 4


def test_model_config_imports_without_torch() -> None:
    code = "import sys, kvpilot.model.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_model_folder_raises_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="existing folder"):
        resolve_model_path(str(tmp_path / "nope"))


def test_folder_without_config_raises_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        ModelConfig.from_folder(tmp_path)


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    _write(tmp_path, {"architectures": ["GPT2LMHeadModel"], "hidden_size": 8})
    with pytest.raises(UnsupportedArchitecture, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelConfig.from_folder(tmp_path)


def test_malformed_config_json_raises_model_load_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        ModelConfig.from_folder(tmp_path)


def test_missing_required_field_is_named(
    hf_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    raw = _raw(hf_checkpoint("llama"))
    del raw["num_hidden_layers"]
    _write(tmp_path, raw)
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        ModelConfig.from_folder(tmp_path)


def test_field_of_the_wrong_type_is_named(hf_checkpoint: Callable[[str], Path]) -> None:
    raw = _raw(hf_checkpoint("llama"))
    with pytest.raises(ModelLoadError, match=r"hidden_size.*'64'"):
        ModelConfig.from_dict({**raw, "hidden_size": "64"})
    with pytest.raises(ModelLoadError, match="num_key_value_heads"):
        ModelConfig.from_dict({**raw, "num_key_value_heads": 3})


def test_unsupported_rope_type_is_rejected(hf_checkpoint: Callable[[str], Path]) -> None:
    raw = _raw(hf_checkpoint("llama"))
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ModelLoadError, match=r"yarn.*llama3"):
        ModelConfig.from_dict(raw)


def test_checkpoint_missing_a_weight_raises_model_load_error(
    hf_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    folder = _copy_checkpoint(hf_checkpoint("llama"), tmp_path / "broken")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        ModelRunner(folder, num_blocks=4)


def test_checkpoint_without_weights_raises_model_load_error(
    hf_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = _copy_checkpoint(hf_checkpoint("llama"), tmp_path / "empty")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        ModelRunner(folder, num_blocks=4)


def test_weight_shape_that_contradicts_the_config_is_reported(
    hf_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = _copy_checkpoint(hf_checkpoint("llama"), tmp_path / "wide", intermediate_size=256)
    with pytest.raises(ModelLoadError, match=r"gate_proj.*shape"):
        ModelRunner(folder, num_blocks=4)
