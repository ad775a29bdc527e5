"""A model's geometry from its Hugging Face ``config.json`` (no download, no transformers).

The parameter count is estimated from the config: embeddings (once when tied), attention
(GQA or MLA), MLP (dense or mixture-of-experts), norms. The layer kinds (full, sliding
window, linear) come from `kvpilot.sizing.layers`; the context limit from
``max_position_embeddings``. A config with no dtype is taken as bf16, which is what
checkpoints are published in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpilot.errors import ConfigError
from kvpilot.sizing.geometry import ModelGeometry, normalize_weight_dtype
from kvpilot.sizing.layers import layer_groups_from_config

# Families whose config class ties the LM head to the embeddings unless the config says
# otherwise (transformers' defaults; Llama, Qwen, Mistral and DeepSeek default to untied).
_TIED_BY_DEFAULT = frozenset(
    {
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "recurrent_gemma",
        "vaultgemma",
        "cohere",
        "cohere2",
        "gpt2",
        "starcoder2",
        "falcon",
        "bloom",
        "opt",
        "mpt",
        "smollm3",
        "minicpm3",
    }
)
# Gemma 2 and 3 norm both before and after the attention and the MLP: four norms a layer.
_FOUR_NORMS = frozenset({"gemma2", "gemma3", "gemma3_text"})


def _read_config(path: Path) -> dict[str, Any]:
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"no config.json at {file}") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {file} as a Hugging Face config.json: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{file} is not a JSON object, so not a Hugging Face config.json")
    # Multimodal checkpoints keep the language model's shape under text_config.
    text = data.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" in text:
        return {**data, **text}
    return data


def _int_field(cfg: dict[str, Any], key: str, source: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
    return value


def _opt_int(cfg: dict[str, Any], key: str, default: int) -> int:
    value = cfg.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _mlp_params(hidden: int, intermediate: int) -> int:
    return 3 * hidden * intermediate  # gate, up and down projections (SwiGLU / GeGLU)


def _attention_params(cfg: dict[str, Any], hidden: int, heads: int, kv_heads: int, d: int) -> int:
    if cfg.get("kv_lora_rank"):
        rank = int(cfg["kv_lora_rank"])
        rope = _opt_int(cfg, "qk_rope_head_dim", 64)
        nope = _opt_int(cfg, "qk_nope_head_dim", 128)
        v_dim = _opt_int(cfg, "v_head_dim", 128)
        q_rank = cfg.get("q_lora_rank")
        if q_rank:
            q = hidden * q_rank + q_rank + q_rank * heads * (nope + rope)
        else:
            q = hidden * heads * (nope + rope)
        kv = hidden * (rank + rope) + rank + rank * heads * (nope + v_dim)
        return q + kv + heads * v_dim * hidden
    params = 2 * hidden * heads * d + 2 * hidden * kv_heads * d
    if cfg.get("attention_bias") or cfg.get("model_type") == "qwen2":
        params += heads * d + 2 * kv_heads * d
    if cfg.get("model_type") in ("qwen3", "qwen3_moe"):
        params += 2 * d  # per-head q and k RMSNorm
    return params


def _mlp_layers_params(cfg: dict[str, Any], hidden: int, layers: int) -> tuple[int, int]:
    """Total and per-token-active MLP parameters over all layers."""
    intermediate = _opt_int(cfg, "intermediate_size", 4 * hidden)
    experts = _opt_int(cfg, "n_routed_experts", 0) or _opt_int(
        cfg, "num_local_experts", _opt_int(cfg, "num_experts", 0)
    )
    if experts == 0:
        dense = _mlp_params(hidden, intermediate)
        return layers * dense, layers * dense
    moe_inter = _opt_int(cfg, "moe_intermediate_size", intermediate)
    top_k = _opt_int(cfg, "num_experts_per_tok", 2)
    shared = _opt_int(cfg, "n_shared_experts", 0) * _mlp_params(hidden, moe_inter)
    shared += _mlp_params(hidden, _opt_int(cfg, "shared_expert_intermediate_size", 0))
    dense_layers = min(_opt_int(cfg, "first_k_dense_replace", 0), layers)
    router = hidden * experts
    expert = _mlp_params(hidden, moe_inter)
    moe_total = experts * expert + shared + router
    moe_active = top_k * expert + shared + router
    dense = _mlp_params(hidden, intermediate)
    moe_layers = layers - dense_layers
    return (
        dense_layers * dense + moe_layers * moe_total,
        dense_layers * dense + moe_layers * moe_active,
    )


def weight_dtype_of(cfg: dict[str, Any]) -> str:
    """The weights' dtype: a quantisation config first, then torch_dtype (or dtype)."""
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict):
        method = str(quant.get("quant_method", "")).lower()
        bits = quant.get("bits", quant.get("w_bit"))
        if method == "fp8":
            return "fp8"
        if bits in (4, 8) and method in ("awq", "gptq", "compressed-tensors", "bitsandbytes"):
            return f"int{bits}"
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bf16"
    return normalize_weight_dtype("bf16" if dtype == "auto" else str(dtype))


def from_hf_config(path: str | Path) -> ModelGeometry:
    """Geometry of a Hugging Face checkpoint: its config.json, or a folder holding one."""
    path = Path(path)
    cfg = _read_config(path)
    source = str(path)
    layers = _int_field(cfg, "num_hidden_layers", source)
    hidden = _int_field(cfg, "hidden_size", source)
    heads = _int_field(cfg, "num_attention_heads", source)
    kv_heads = _opt_int(cfg, "num_key_value_heads", heads)
    head_dim = _opt_int(cfg, "head_dim", hidden // heads)
    vocab = _opt_int(cfg, "vocab_size", 32000)
    model_type = str(cfg.get("model_type", ""))
    weight_dtype = weight_dtype_of(cfg)

    attention = _attention_params(cfg, hidden, heads, kv_heads, head_dim)
    mlp_total, mlp_active = _mlp_layers_params(cfg, hidden, layers)
    norms = layers * (4 if model_type in _FOUR_NORMS else 2) * hidden + hidden
    tied = cfg.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)
    embeddings = vocab * hidden * (1 if tied else 2)
    common = embeddings + layers * attention + norms

    kv_lora_rank = cfg.get("kv_lora_rank") or None
    rope = _opt_int(cfg, "qk_rope_head_dim", 64) if kv_lora_rank else None
    if rope is not None:
        head_dim = _opt_int(cfg, "qk_nope_head_dim", 128) + rope
    max_context = cfg.get("max_position_embeddings")
    if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context <= 0:
        max_context = None
    name = path.parent.name if path.is_file() else path.name
    kv_dtype = weight_dtype if weight_dtype in ("bf16", "fp16", "fp32") else "bf16"
    return ModelGeometry(
        name=name or model_type or "model",
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_params=float(common + mlp_total),
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        hidden_size=hidden,
        num_attention_heads=heads,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope,
        num_active_params=float(common + mlp_active) if mlp_active != mlp_total else None,
        layer_groups=layer_groups_from_config(cfg, layers, source),
        max_context_tokens=max_context,
    )
