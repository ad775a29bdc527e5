"""Small Hugging Face checkpoints built with transformers' own classes (tests, benchmarks).

Weights are redrawn from a seeded torch generator, independent of transformers' init code:
norms get weights near 1 and biases are non-zero (so those paths are exercised), linear
layers N(0, gain²/fan_in). The gains make every output depend on the whole context (within
Mistral's sliding window): attention writes 3x more into the residual stream than a plain
layer and its scores are 1.5x sharper, and the head has clear margins. Qwen2 ties its head to
the embeddings, so its embeddings are small: a residual stream dominated by the input
embedding would make a model that repeats its last token whatever the context, on which no
cache test could fail. `tests/test_sensitivity.py` pins the property for every factory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpilot.model.tokenizer import (
    END_OF_TURN_TOKEN,
    EOS_TOKEN,
    save_byte_tokenizer,
    special_token_id,
)

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")

_BASE: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "bos_token_id": None,
    "eos_token_id": [special_token_id(EOS_TOKEN), special_token_id(END_OF_TURN_TOKEN)],
    "pad_token_id": special_token_id(EOS_TOKEN),
}

_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "tie_word_embeddings": False,
    },
    "qwen2": {"rope_theta": 1000000.0, "tie_word_embeddings": True},
    "qwen3": {"head_dim": 32, "tie_word_embeddings": False},
    # The window covers a 48-token prompt (the sensitivity tests'), not the longer contexts
    # of the engine tests, where it masks keys.
    "mistral": {"sliding_window": 48, "tie_word_embeddings": False},
}


@dataclass(frozen=True, slots=True)
class _Gains:
    """Embedding and head: standard deviations; the others: gains over N(0, 1/fan_in)."""

    embedding: float = 1.0
    head: float = 1.0
    attention_out: float = 3.0
    query_key: float = 1.5


_GAINS: dict[str, _Gains] = {
    "llama": _Gains(),
    "qwen2": _Gains(embedding=0.2, attention_out=4.0),  # tied head: small embeddings
    "qwen3": _Gains(),
    "mistral": _Gains(),
}


def _gain(name: str, gains: _Gains) -> float:
    if ".o_proj." in name:
        return gains.attention_out
    if ".q_proj." in name or ".k_proj." in name:
        return gains.query_key
    return 1.0


def _classes(arch: str) -> tuple[type, type]:
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[arch]


def make_checkpoint(
    arch: str, path: Path, *, seed: int = 0, max_shard_size: str | None = None, **overrides: Any
) -> Path:
    """Write a tiny ``arch`` checkpoint (fp32, byte-level tokenizer) to ``path`` and return it.

    ``overrides`` are config fields (e.g. ``num_hidden_layers=3``, ``sliding_window=None``);
    ``max_shard_size`` (e.g. ``"100KB"``) writes a sharded checkpoint.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown test architecture {arch!r}; choose from {ARCHITECTURES}")
    config_cls, model_cls = _classes(arch)
    config = config_cls(**{**_BASE, **_ARCH_DEFAULTS[arch], **overrides})
    model = model_cls(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    gains = _GAINS[arch]
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                param.copy_(gains.embedding * noise)
            elif name == "lm_head.weight":
                param.copy_(gains.head * noise)
            else:
                param.copy_(_gain(name, gains) * noise * param.shape[-1] ** -0.5)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(path), **kwargs)
    save_byte_tokenizer(path)
    return path
