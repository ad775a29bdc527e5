"""Which layers keep what: full attention, a sliding window, or a fixed recurrent state.

Hybrid models mix layer kinds, and their KV does not grow like equation 1 says:

- a *full* attention layer caches K and V for every token of the sequence;
- a *window* layer (sliding window ``W``, or Llama-4-style chunked attention) attends to at
  most the last ``W`` tokens, so a sequence never needs more than ``W`` tokens of its KV;
- a *state* layer (linear attention, e.g. Qwen3-Next's gated DeltaNet) holds a fixed
  recurrent state per sequence, whatever its length.

`layer_groups_from_config` reads the kinds from a Hugging Face ``config.json`` the way
``transformers`` builds ``layer_types``:

- an explicit ``layer_types`` list (``full_attention``, ``sliding_attention``,
  ``chunked_attention``, ``linear_attention``);
- Qwen2/Qwen3 families: ``use_sliding_window`` (default false) windows the layers from
  ``max_window_layers`` on;
- ``sliding_window_pattern`` P (Gemma 3, Cohere 2): every P-th layer is full, the others
  windowed; Gemma 2 alternates (even-numbered layers windowed, odd ones full);
- any other config with a positive ``sliding_window`` (Mistral 7B v0.1, Phi-3, Starcoder 2)
  windows every layer.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvpilot.errors import ConfigError

FULL = "full"
WINDOW = "window"
STATE = "state"
KINDS = (FULL, WINDOW, STATE)

# model_type -> (use_sliding_window default, max_window_layers default): the Qwen families,
# whose configs carry a sliding_window that only counts when use_sliding_window is true.
_QWEN_STYLE: dict[str, int] = {"qwen2": 28, "qwen2_moe": 28, "qwen3": 28, "qwen3_moe": 28}
# model_type -> sliding_window_pattern when the config leaves it out.
_PATTERN_DEFAULTS: dict[str, int] = {
    "gemma2": 2,
    "gemma3": 6,
    "gemma3_text": 6,
    "cohere2": 4,
}
_LAYER_TYPE_KINDS: dict[str, str] = {
    "full_attention": FULL,
    "attention": FULL,
    "sliding_attention": WINDOW,
    "chunked_attention": WINDOW,
    "linear_attention": STATE,
}


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """``num_layers`` layers of one kind.

    ``window_tokens`` (window layers): the most tokens of a sequence such a layer keeps.
    ``state_elems`` (state layers): elements of one sequence's recurrent state per layer, for
    the whole model (split across a tensor-parallel group like the heads are).
    """

    kind: str
    num_layers: int
    window_tokens: int | None = None
    state_elems: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"layer kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.num_layers <= 0:
            raise ConfigError(f"a {self.kind} layer group needs at least one layer")
        if (self.kind == WINDOW) != (self.window_tokens is not None):
            raise ConfigError("window_tokens is set for window layers, and only for them")
        if self.window_tokens is not None and self.window_tokens <= 0:
            raise ConfigError(f"a sliding window must be positive, got {self.window_tokens}")
        if (self.kind == STATE) != (self.state_elems > 0):
            raise ConfigError("state layers need a positive state_elems (and only they have one)")

    def kept_tokens(self, tokens: int) -> int:
        """Tokens of a ``tokens``-long sequence whose KV a layer of this group keeps."""
        if self.kind == FULL:
            return tokens
        if self.kind == WINDOW:
            assert self.window_tokens is not None
            return min(tokens, self.window_tokens)
        return 0

    def describe(self) -> str:
        if self.kind == FULL:
            return f"{self.num_layers} full-attention"
        if self.kind == WINDOW:
            return f"{self.num_layers} sliding-window ({self.window_tokens:,} tokens)"
        return f"{self.num_layers} linear-attention (fixed state)"


def _positive_int(cfg: dict[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def _layer_kinds(cfg: dict[str, Any], num_layers: int, source: str) -> list[tuple[str, int]]:
    """(kind, window or 0) for every layer, in order."""
    window = _positive_int(cfg, "sliding_window")
    model_type = str(cfg.get("model_type", ""))
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ConfigError(
                f"{source}: layer_types must list one type for each of the {num_layers} layers"
            )
        out = []
        for i, name in enumerate(types):
            kind = _LAYER_TYPE_KINDS.get(str(name))
            if kind is None:
                raise ConfigError(
                    f"{source}: layer {i} has type {name!r}; kvpilot sizes "
                    f"{', '.join(_LAYER_TYPE_KINDS)}"
                )
            size = 0
            if name == "chunked_attention":
                size = _positive_int(cfg, "attention_chunk_size") or 0
                if not size:
                    raise ConfigError(f"{source}: chunked_attention needs attention_chunk_size")
            elif kind == WINDOW:
                if window is None:
                    raise ConfigError(f"{source}: sliding_attention layers need a sliding_window")
                size = window
            out.append((kind, size))
        return out
    if model_type in _QWEN_STYLE:
        first = cfg.get("max_window_layers", _QWEN_STYLE[model_type])
        if cfg.get("use_sliding_window", False) and window is not None:
            return [(WINDOW, window) if i >= first else (FULL, 0) for i in range(num_layers)]
        return [(FULL, 0)] * num_layers
    pattern = _positive_int(cfg, "sliding_window_pattern") or _PATTERN_DEFAULTS.get(model_type)
    if model_type == "gemma2" and window is None:
        window = 4096  # Gemma 2's default when the config leaves it out
    if window is None:
        return [(FULL, 0)] * num_layers
    if pattern is not None:
        # transformers: layer i is sliding when (i + 1) % pattern != 0.
        return [(WINDOW, window) if (i + 1) % pattern else (FULL, 0) for i in range(num_layers)]
    return [(WINDOW, window)] * num_layers


def linear_state_elems(cfg: dict[str, Any], source: str) -> int:
    """Elements of one sequence's gated-DeltaNet state per layer (Qwen3-Next's linear layers):
    the convolution state ``(conv_kernel - 1) * conv_dim`` and the recurrent state
    ``value_heads * key_dim * value_dim``, as vLLM allocates them."""
    keys = (
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
    )
    values = [_positive_int(cfg, k) for k in keys]
    if any(v is None for v in values):
        missing = [k for k, v in zip(keys, values, strict=True) if v is None]
        raise ConfigError(
            f"{source}: linear_attention layers need {', '.join(missing)} to size their state"
        )
    k_heads, v_heads, k_dim, v_dim, kernel = (int(v) for v in values if v is not None)
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    return (kernel - 1) * conv_dim + v_heads * k_dim * v_dim


def layer_groups_from_config(
    cfg: dict[str, Any], num_layers: int, source: str = "config.json"
) -> tuple[LayerGroup, ...]:
    """The model's layers grouped by kind: full first, then windows (smallest first), state."""
    kinds = _layer_kinds(cfg, num_layers, source)
    counts = Counter(kinds)
    groups: list[LayerGroup] = []
    if counts[(FULL, 0)]:
        groups.append(LayerGroup(FULL, counts[(FULL, 0)]))
    for (kind, size), n in sorted(counts.items(), key=lambda kv: kv[0][1]):
        if kind == WINDOW:
            groups.append(LayerGroup(WINDOW, n, window_tokens=size))
    if counts[(STATE, 0)]:
        groups.append(
            LayerGroup(STATE, counts[(STATE, 0)], state_elems=linear_state_elems(cfg, source))
        )
    return tuple(groups)


def split_elems(elems: int, tp: int) -> int:
    """One device's share of ``elems`` split across ``tp`` devices (rounded up)."""
    return math.ceil(elems / tp)
