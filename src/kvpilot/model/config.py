"""`ModelConfig`: the geometry of a Llama-family checkpoint, read from its config.json.

Accepts both config styles Hugging Face has written: the older one (``rope_theta`` at top
level, ``rope_scaling`` dict) and transformers 5's ``rope_parameters``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.errors import ModelLoadError, UnsupportedArchitecture

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Non-default RoPE frequency scaling (``linear`` or ``llama3``)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What kvpilot needs to run a checkpoint. Built by `ModelConfig.from_folder`.

    ``attention_bias`` means biases on q/k/v; ``o_proj_bias`` on the output projection
    (Qwen2 has the former only). ``sliding_layers[i]`` says whether layer i uses
    ``sliding_window`` (a key at position j is visible from query position p iff
    ``p - sliding_window < j <= p``).
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    sliding_layers: tuple[bool, ...]
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.sliding_layers[layer] else None

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"no config.json in {folder}: is this a Hugging Face checkpoint?")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        fields = _Fields(raw, source)
        architecture = _architecture(raw, source)
        hidden = fields.integer("hidden_size")
        heads = fields.integer("num_attention_heads")
        kv_heads = fields.integer("num_key_value_heads", default=heads)
        layers = fields.integer("num_hidden_layers")
        head_dim = fields.integer("head_dim", default=hidden // heads if heads else 0)
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        act = fields.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        rope_theta, rope_scaling = _rope(fields, source)
        model_type = str(fields.get("model_type", architecture))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = True if is_qwen2 else fields.boolean("attention_bias", default=False)
        window, sliding_layers = _sliding(fields, architecture, layers, source)
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=fields.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=fields.integer("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=fields.number("rms_norm_eps", default=1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=fields.integer("max_position_embeddings"),
            tie_word_embeddings=fields.boolean("tie_word_embeddings", default=False),
            attention_bias=attention_bias,
            o_proj_bias=False if is_qwen2 else attention_bias,
            mlp_bias=fields.boolean("mlp_bias", default=False),
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=window,
            sliding_layers=sliding_layers,
            eos_token_ids=fields.token_ids("eos_token_id"),
            bos_token_id=fields.optional_integer("bos_token_id"),
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        )


class _Fields:
    """Typed access to config.json fields with errors that name the field."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    def _fail(self, key: str, expected: str) -> ModelLoadError:
        if key not in self.raw:
            return ModelLoadError(f"{self.source}: missing required field {key!r} ({expected})")
        return ModelLoadError(
            f"{self.source}: field {key!r} must be {expected}, got {self.raw[key]!r}"
        )

    def integer(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._fail(key, f"an integer >= {minimum}")
        return value

    def optional_integer(self, key: str) -> int | None:
        value = self.raw.get(key)
        if value is None:
            return None
        return self.integer(key, minimum=0)

    def number(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise self._fail(key, "a positive number")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self._fail(key, "true or false")
        return value

    def token_ids(self, key: str) -> tuple[int, ...]:
        value = self.raw.get(key)
        if value is None:
            return ()
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise self._fail(key, "a token id or a list of token ids")
        return tuple(dict.fromkeys(values))


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise ModelLoadError(
            f"{source}: missing or malformed field 'architectures' "
            f'(expected a list such as ["LlamaForCausalLM"], got {archs!r})'
        )
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise UnsupportedArchitecture(
        f"{source}: architecture {', '.join(archs)} is not supported; kvpilot runs "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(fields: _Fields, source: str) -> tuple[float, RopeScaling | None]:
    params = fields.raw.get("rope_parameters")
    if params is None:
        params = fields.raw.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ModelLoadError(f"{source}: field 'rope_parameters' must be an object, got {params!r}")
    params = dict(params or {})
    theta_raw = params.get("rope_theta", fields.raw.get("rope_theta", 10000.0))
    if isinstance(theta_raw, bool) or not isinstance(theta_raw, int | float) or theta_raw <= 0:
        raise ModelLoadError(f"{source}: field 'rope_theta' must be a positive number")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported; kvpilot implements "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", fields.raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor {partial!r} is not supported")
    if rope_type == "default":
        return float(theta_raw), None
    sub = _Fields(params, f"{source} rope_parameters")
    if rope_type == "linear":
        return float(theta_raw), RopeScaling("linear", factor=sub.number("factor"))
    return float(theta_raw), RopeScaling(
        "llama3",
        factor=sub.number("factor"),
        low_freq_factor=sub.number("low_freq_factor"),
        high_freq_factor=sub.number("high_freq_factor"),
        original_max_position_embeddings=sub.integer("original_max_position_embeddings"),
    )


def _sliding(
    fields: _Fields, architecture: str, layers: int, source: str
) -> tuple[int | None, tuple[bool, ...]]:
    window = fields.raw.get("sliding_window")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not fields.raw.get(
        "use_sliding_window", False
    ):
        window = None
    if window is None:
        return None, (False,) * layers
    window = fields.integer("sliding_window")
    layer_types = fields.raw.get("layer_types")
    if layer_types is None:
        if architecture == "MistralForCausalLM":
            return window, (True,) * layers
        first = fields.integer("max_window_layers", default=0, minimum=0)
        return window, tuple(i >= first for i in range(layers))
    if not isinstance(layer_types, list) or len(layer_types) != layers:
        raise ModelLoadError(
            f"{source}: field 'layer_types' must list one attention type per layer ({layers})"
        )
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ModelLoadError(f"{source}: unsupported layer_types {sorted(map(str, unknown))}")
    return window, tuple(t == "sliding_attention" for t in layer_types)
