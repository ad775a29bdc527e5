"""Model geometry: what a model's KV cache and weights cost in bytes (spec equations 1 and 4)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.errors import ConfigError

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}

_DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "fp8": "fp8",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
}


def normalize_dtype(name: str) -> str:
    """Canonical dtype name (bf16, fp16, fp32, fp8) for any common spelling."""
    key = name.strip().lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise ConfigError(f"unknown dtype {name!r}: use one of {', '.join(DTYPE_BYTES)}")
    return _DTYPE_ALIASES[key]


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """The shape of a decoder-only model, as far as memory sizing needs it.

    Grouped-query models cache K and V for `num_kv_heads` heads of `head_dim` per layer.
    Multi-head latent attention (MLA) models set `kv_lora_rank` and `qk_rope_head_dim` and
    cache one compressed latent of `kv_lora_rank + qk_rope_head_dim` elements per layer instead.
    `num_active_params` is the parameter count a token passes through (smaller than
    `num_params` for mixture-of-experts models); prefill FLOPs follow it, weight bytes do not.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: float
    weight_dtype: str
    kv_dtype: str
    hidden_size: int
    num_attention_heads: int
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    num_active_params: float | None = None

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "hidden_size"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"model {self.name!r}: {field} must be positive")
        if self.num_params <= 0:
            raise ConfigError(f"model {self.name!r}: num_params must be positive")
        object.__setattr__(self, "weight_dtype", normalize_dtype(self.weight_dtype))
        object.__setattr__(self, "kv_dtype", normalize_dtype(self.kv_dtype))
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ConfigError(
                f"model {self.name!r}: an MLA model needs both kv_lora_rank and qk_rope_head_dim"
            )

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def kv_elem_bytes(self) -> int:
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def flops_params(self) -> float:
        """Parameters a token's forward pass multiplies through (2 FLOPs each)."""
        return self.num_active_params if self.num_active_params is not None else self.num_params

    def kv_heads_per_device(self, tp: int = 1) -> int:
        """KV heads one device holds: heads split across TP, replicated once TP exceeds them."""
        if tp <= 0:
            raise ConfigError(f"tensor parallel degree must be positive, got {tp}")
        heads = self.num_kv_heads
        if heads % tp == 0:
            return heads // tp
        if tp % heads == 0:
            return 1
        raise ConfigError(
            f"model {self.name!r} has {heads} KV heads: tensor parallel degree {tp} must "
            f"divide it or be a multiple of it"
        )

    def bytes_per_token(self, tp: int = 1) -> int:
        """KV bytes one token costs on one device of a TP group (tp=1: the whole model).

        Grouped-query attention: 2 * L * (H_kv / tp) * d_head * b (spec equation 1), with
        heads replicated when tp exceeds H_kv. MLA: L * (kv_lora_rank + qk_rope_head_dim) * b,
        the same on every device, because the latent is replicated across the TP group rather
        than split (each device needs the whole latent to expand its own heads).
        """
        if self.is_mla:
            if tp <= 0:
                raise ConfigError(f"tensor parallel degree must be positive, got {tp}")
            assert self.kv_lora_rank is not None and self.qk_rope_head_dim is not None
            latent = self.kv_lora_rank + self.qk_rope_head_dim
            return self.num_layers * latent * self.kv_elem_bytes
        heads = self.kv_heads_per_device(tp)
        return 2 * self.num_layers * heads * self.head_dim * self.kv_elem_bytes

    def group_bytes_per_token(self, tp: int = 1) -> int:
        """KV bytes one token costs across a whole TP group, counting replicated copies."""
        return self.bytes_per_token(tp) * tp

    def kv_bytes(self, tokens: int, tp: int = 1) -> int:
        """KV bytes of `tokens` tokens on one device of a TP group (tp=1: the whole model)."""
        return tokens * self.bytes_per_token(tp)

    def weight_bytes(self, tp: int = 1) -> float:
        """Weight bytes on one device of a TP group (spec equation 4, PP=1)."""
        if tp <= 0:
            raise ConfigError(f"tensor parallel degree must be positive, got {tp}")
        return self.num_params * DTYPE_BYTES[self.weight_dtype] / tp


PRESETS: dict[str, ModelGeometry] = {
    g.name: g
    for g in (
        ModelGeometry("llama-3-8b", 32, 8, 128, 8.03e9, "bf16", "bf16", 4096, 32),
        ModelGeometry("llama-3-70b", 80, 8, 128, 70.6e9, "bf16", "bf16", 8192, 64),
        ModelGeometry("qwen2.5-7b", 28, 4, 128, 7.62e9, "bf16", "bf16", 3584, 28),
        ModelGeometry("qwen3-8b", 36, 8, 128, 8.19e9, "bf16", "bf16", 4096, 32),
        ModelGeometry("mistral-7b", 32, 8, 128, 7.24e9, "bf16", "bf16", 4096, 32),
        ModelGeometry(
            "deepseek-v3",
            61,
            128,
            192,
            671e9,
            "fp8",
            "bf16",
            7168,
            128,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            num_active_params=37e9,
        ),
    )
}


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
    return 3 * hidden * intermediate  # gate, up and down projections (SwiGLU)


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


def from_hf_config(path: str | Path) -> ModelGeometry:
    """Geometry of a Hugging Face checkpoint from its config.json (a file or a folder holding one).

    The parameter count is estimated from the config: embeddings, attention, MLP (dense or
    mixture-of-experts), norms, and the LM head unless tied. A config with no dtype is taken
    as bf16, which is what checkpoints are published in.
    """
    path = Path(path)
    cfg = _read_config(path)
    source = str(path)
    layers = _int_field(cfg, "num_hidden_layers", source)
    hidden = _int_field(cfg, "hidden_size", source)
    heads = _int_field(cfg, "num_attention_heads", source)
    kv_heads = _opt_int(cfg, "num_key_value_heads", heads)
    head_dim = _opt_int(cfg, "head_dim", hidden // heads)
    vocab = _opt_int(cfg, "vocab_size", 32000)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bf16"
    weight_dtype = "bf16" if dtype == "auto" else str(dtype)
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        weight_dtype = "fp8"

    attention = _attention_params(cfg, hidden, heads, kv_heads, head_dim)
    mlp_total, mlp_active = _mlp_layers_params(cfg, hidden, layers)
    norms = layers * 2 * hidden + hidden
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    common = embeddings + layers * attention + norms

    kv_lora_rank = cfg.get("kv_lora_rank") or None
    rope = _opt_int(cfg, "qk_rope_head_dim", 64) if kv_lora_rank else None
    if rope is not None:
        head_dim = _opt_int(cfg, "qk_nope_head_dim", 128) + rope
    name = path.parent.name if path.is_file() else path.name
    return ModelGeometry(
        name=name or str(cfg.get("model_type", "model")),
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_params=float(common + mlp_total),
        weight_dtype=weight_dtype,
        kv_dtype=weight_dtype if weight_dtype != "fp8" else "bf16",
        hidden_size=hidden,
        num_attention_heads=heads,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope,
        num_active_params=float(common + mlp_active) if mlp_active != mlp_total else None,
    )


def resolve_geometry(name_or_path: str | Path, kv_dtype: str | None = None) -> ModelGeometry:
    """A preset by name or the geometry of a config.json path; `kv_dtype` overrides the KV dtype."""
    key = str(name_or_path).strip().lower()
    if key in PRESETS:
        geometry = PRESETS[key]
    elif Path(name_or_path).exists():
        try:
            geometry = from_hf_config(name_or_path)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (or use a preset: {', '.join(PRESETS)})") from exc
    else:
        raise ConfigError(
            f"unknown model {str(name_or_path)!r}: use a preset ({', '.join(PRESETS)}) "
            f"or a path to a Hugging Face config.json or a folder holding one"
        )
    if kv_dtype is not None:
        geometry = dataclasses.replace(geometry, kv_dtype=normalize_dtype(kv_dtype))
    return geometry
