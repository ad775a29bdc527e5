"""Model geometry: what a model's KV cache and weights cost in bytes (spec equations 1 and 4).

Equation 1 counts every layer: ``m_token = 2 * L * H_kv * d_head * b``. That is the whole
story for full-attention models. Hybrid models (`kvpilot.sizing.layers`) keep every token
only in their full-attention layers; a sliding-window layer keeps at most its window, a
linear-attention layer a fixed state. So a sequence of ``S`` tokens holds::

    full_layers * m_layer * S  +  sum over window groups of  n_g * m_layer * min(S, W_g)
                               +  state layers * state bytes

where ``m_layer = 2 * H_kv * d_head * b`` is one layer's bytes per token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from kvpilot.errors import ConfigError
from kvpilot.sizing.layers import FULL, STATE, WINDOW, LayerGroup, split_elems

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
# Weights may also be integer-quantised. int4 is half a byte per parameter; the per-group
# scales of AWQ/GPTQ (one fp16 per 128 weights: +3%) are left out.
WEIGHT_DTYPE_BYTES: dict[str, float] = {**DTYPE_BYTES, "int8": 1, "int4": 0.5}

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
    "int8": "int8",
    "w8a16": "int8",
    "int4": "int4",
    "w4a16": "int4",
}


def normalize_dtype(name: str) -> str:
    """Canonical KV dtype name (bf16, fp16, fp32, fp8) for any common spelling."""
    key = _DTYPE_ALIASES.get(name.strip().lower().removeprefix("torch."))
    if key not in DTYPE_BYTES:
        raise ConfigError(f"unknown KV dtype {name!r}: use one of {', '.join(DTYPE_BYTES)}")
    return key


def normalize_weight_dtype(name: str) -> str:
    """Canonical weights dtype name (bf16, fp16, fp32, fp8, int8, int4)."""
    key = _DTYPE_ALIASES.get(name.strip().lower().removeprefix("torch."))
    if key is None:
        raise ConfigError(
            f"unknown weights dtype {name!r}: use one of {', '.join(WEIGHT_DTYPE_BYTES)}"
        )
    return key


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """The shape of a decoder-only model, as far as memory sizing needs it.

    Grouped-query models cache K and V for `num_kv_heads` heads of `head_dim` per layer.
    Multi-head latent attention (MLA) models set `kv_lora_rank` and `qk_rope_head_dim` and
    cache one compressed latent of `kv_lora_rank + qk_rope_head_dim` elements per layer instead.
    `num_active_params` is the parameter count a token passes through (smaller than
    `num_params` for mixture-of-experts models); prefill FLOPs follow it, weight bytes do not.
    `layer_groups` says which layers are full attention, sliding window or linear (empty:
    all `num_layers` are full attention); `max_context_tokens` is the model's context limit
    (``max_position_embeddings``), None when unknown.
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
    layer_groups: tuple[LayerGroup, ...] = ()
    max_context_tokens: int | None = None

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "hidden_size"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"model {self.name!r}: {field} must be positive")
        if self.num_params <= 0:
            raise ConfigError(f"model {self.name!r}: num_params must be positive")
        object.__setattr__(self, "weight_dtype", normalize_weight_dtype(self.weight_dtype))
        object.__setattr__(self, "kv_dtype", normalize_dtype(self.kv_dtype))
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ConfigError(
                f"model {self.name!r}: an MLA model needs both kv_lora_rank and qk_rope_head_dim"
            )
        if self.layer_groups and sum(g.num_layers for g in self.layer_groups) != self.num_layers:
            raise ConfigError(
                f"model {self.name!r}: layer groups cover "
                f"{sum(g.num_layers for g in self.layer_groups)} layers, not {self.num_layers}"
            )
        if self.max_context_tokens is not None and self.max_context_tokens <= 0:
            raise ConfigError(f"model {self.name!r}: max_context_tokens must be positive")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def kv_elem_bytes(self) -> int:
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        return self.layer_groups or (LayerGroup(FULL, self.num_layers),)

    @property
    def num_full_layers(self) -> int:
        return sum(g.num_layers for g in self.groups if g.kind == FULL)

    @property
    def num_kv_layers(self) -> int:
        """Layers with a per-token KV cache (full attention and sliding window)."""
        return sum(g.num_layers for g in self.groups if g.kind != STATE)

    @property
    def window_groups(self) -> tuple[LayerGroup, ...]:
        return tuple(g for g in self.groups if g.kind == WINDOW)

    @property
    def is_hybrid(self) -> bool:
        return any(g.kind != FULL for g in self.groups)

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

    def layer_bytes_per_token(self, tp: int = 1) -> int:
        """KV bytes one token costs in one attention layer, on one device of a TP group.

        Grouped-query attention: 2 * (H_kv / tp) * d_head * b, heads replicated when tp exceeds
        H_kv. MLA: (kv_lora_rank + qk_rope_head_dim) * b on every device, because the latent
        is replicated across the TP group rather than split (each device needs the whole
        latent to expand its own heads).
        """
        if self.is_mla:
            if tp <= 0:
                raise ConfigError(f"tensor parallel degree must be positive, got {tp}")
            assert self.kv_lora_rank is not None and self.qk_rope_head_dim is not None
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_elem_bytes
        return 2 * self.kv_heads_per_device(tp) * self.head_dim * self.kv_elem_bytes

    def bytes_per_token(self, tp: int = 1) -> int:
        """Equation 1: KV bytes one token costs in every attention layer, on one device.

        For a full-attention model this is the whole per-token cost; for a hybrid model it is
        what an engine with one block table for all layers allocates (window layers too).
        """
        return self.num_kv_layers * self.layer_bytes_per_token(tp)

    def full_bytes_per_token(self, tp: int = 1) -> int:
        """KV bytes per token of the full-attention layers only: what grows without bound."""
        return self.num_full_layers * self.layer_bytes_per_token(tp)

    def state_bytes_per_seq(self, tp: int = 1) -> int:
        """Fixed state one sequence holds in the linear-attention layers, on one device."""
        elem = DTYPE_BYTES[self.state_dtype]
        return sum(
            g.num_layers * split_elems(g.state_elems, tp) * elem
            for g in self.groups
            if g.kind == STATE
        )

    @property
    def state_dtype(self) -> str:
        """Recurrent state is kept in the model's float dtype (bf16 for quantised weights)."""
        return self.weight_dtype if self.weight_dtype in DTYPE_BYTES else "bf16"

    def group_bytes_per_token(self, tp: int = 1) -> int:
        """Equation 1 across a whole TP group, counting replicated copies."""
        return self.bytes_per_token(tp) * tp

    def kv_bytes(self, tokens: int, tp: int = 1) -> int:
        """KV bytes a sequence of ``tokens`` tokens holds on one device (tp=1: whole model),
        layer by layer: full layers keep every token, window layers at most their window."""
        per_layer = self.layer_bytes_per_token(tp)
        kept = sum(g.num_layers * g.kept_tokens(tokens) for g in self.groups)
        return kept * per_layer + self.state_bytes_per_seq(tp)

    def shared_and_private_bytes(
        self, tokens: int, shared_tokens: int, tp: int = 1
    ) -> tuple[int, int]:
        """KV bytes, on one device, of ``tokens``-long sequences that all begin with the same
        ``shared_tokens``: (bytes held once for all of them, bytes each one holds alone).

        A window layer keeps the last W tokens; the part of them inside the shared prefix is
        shared, the rest is private. State is private.
        """
        per_layer = self.layer_bytes_per_token(tp)
        shared = private = 0
        for g in self.groups:
            if g.kind == STATE:
                continue
            kept = g.kept_tokens(tokens)
            in_prefix = max(0, shared_tokens - (tokens - kept))
            shared += g.num_layers * in_prefix
            private += g.num_layers * (kept - in_prefix)
        return shared * per_layer, private * per_layer + self.state_bytes_per_seq(tp)

    def weight_bytes(self, tp: int = 1) -> float:
        """Weight bytes on one device of a TP group (spec equation 4, PP=1)."""
        if tp <= 0:
            raise ConfigError(f"tensor parallel degree must be positive, got {tp}")
        return self.num_params * WEIGHT_DTYPE_BYTES[self.weight_dtype] / tp

    def describe_layers(self) -> str:
        """e.g. "21 full-attention + 21 sliding-window (4,096 tokens) layers"."""
        return " + ".join(g.describe() for g in self.groups) + " layers"


# Context limits are the Llama 3.1 / Qwen / Mistral v0.3 releases' max_position_embeddings
# (Llama 3.0 had 8,192 tokens with the same geometry).
PRESETS: dict[str, ModelGeometry] = {
    g.name: g
    for g in (
        ModelGeometry(
            "llama-3-8b", 32, 8, 128, 8.03e9, "bf16", "bf16", 4096, 32, max_context_tokens=131072
        ),
        ModelGeometry(
            "llama-3-70b", 80, 8, 128, 70.6e9, "bf16", "bf16", 8192, 64, max_context_tokens=131072
        ),
        ModelGeometry(
            "qwen2.5-7b", 28, 4, 128, 7.62e9, "bf16", "bf16", 3584, 28, max_context_tokens=131072
        ),
        ModelGeometry(
            "qwen3-8b", 36, 8, 128, 8.19e9, "bf16", "bf16", 4096, 32, max_context_tokens=40960
        ),
        ModelGeometry(
            "mistral-7b", 32, 8, 128, 7.24e9, "bf16", "bf16", 4096, 32, max_context_tokens=32768
        ),
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
            max_context_tokens=163840,
        ),
    )
}


def resolve_geometry(
    name_or_path: str | Path, kv_dtype: str | None = None, weight_dtype: str | None = None
) -> ModelGeometry:
    """A preset by name or the geometry of a config.json path; ``kv_dtype`` and
    ``weight_dtype`` override the dtypes."""
    from kvpilot.sizing.hf_config import from_hf_config

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
    if weight_dtype is not None:
        geometry = dataclasses.replace(geometry, weight_dtype=normalize_weight_dtype(weight_dtype))
    return geometry


def from_hf_config(path: str | Path) -> ModelGeometry:
    """Geometry of a Hugging Face checkpoint's config.json (see `kvpilot.sizing.hf_config`)."""
    from kvpilot.sizing.hf_config import from_hf_config as read

    return read(path)
