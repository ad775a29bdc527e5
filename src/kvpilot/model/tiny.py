"""The built-in ``tiny`` model: a small Llama checkpoint generated on first use, no download.

Weights are deterministic random draws (numpy PCG64, fixed seed), scaled so that every output
depends on the whole context: attention writes 3x more into the residual stream than a plain
N(0, 1/fan_in) layer would and its scores are 1.5x sharper, and the output head is untied
from the embeddings with a 4x gain. (Tied embeddings with a residual stream dominated by the
input embedding make a model that repeats its last token whatever came before it: one on
which a wrong KV block cannot change the output, so no cache test could fail;
`tests/test_sensitivity.py` pins the property.)

The checkpoint is a regular Hugging Face folder (config.json, model.safetensors, byte-level
tokenizer with a chat template), so both kvpilot and transformers' `LlamaForCausalLM` load
it. It is written to a temporary sibling and renamed into place, so a crash or a concurrent
first use never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from kvpilot.model.tokenizer import (
    BYTE_VOCAB_SIZE,
    END_OF_TURN_TOKEN,
    EOS_TOKEN,
    save_byte_tokenizer,
    special_token_id,
)

# The folder name is the cache key: bump it whenever the weights or config change.
TINY_NAME = "tiny-v2"
TINY_SEED = 20240601
DEFAULT_CACHE_DIR = Path("~/.cache/kvpilot/models")

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": BYTE_VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": None,
    "eos_token_id": [special_token_id(EOS_TOKEN), special_token_id(END_OF_TURN_TOKEN)],
    "pad_token_id": special_token_id(EOS_TOKEN),
    "torch_dtype": "float32",
}


# Gains over N(0, 1/fan_in): attention's share of the residual stream, score sharpness, head.
ATTENTION_OUT_GAIN = 3.0
QUERY_KEY_GAIN = 1.5
HEAD_GAIN = 4.0


def tiny_weights(seed: int = TINY_SEED) -> dict[str, np.ndarray]:
    """HF-named float32 weights: linear layers N(0, gain²/fan_in), gains as set above."""
    rng = np.random.Generator(np.random.PCG64(seed))
    c = TINY_CONFIG
    hidden, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_out, kv_out = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> np.ndarray:
        return normal((out_features, in_features), gain * in_features**-0.5)

    def norm(size: int) -> np.ndarray:
        return (1.0 + normal((size,), 0.05)).astype(np.float32)

    weights = {"model.embed_tokens.weight": normal((c["vocab_size"], hidden), 0.5)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "self_attn.q_proj.weight"] = linear(q_out, hidden, QUERY_KEY_GAIN)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_out, hidden, QUERY_KEY_GAIN)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_out, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, q_out, ATTENTION_OUT_GAIN)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    weights["model.norm.weight"] = norm(hidden)
    weights["lm_head.weight"] = linear(c["vocab_size"], hidden, HEAD_GAIN)
    return weights


def write_tiny_model(folder: Path) -> None:
    """Write the tiny checkpoint into an existing empty folder."""
    from safetensors.numpy import save_file

    (folder / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2) + "\n")
    generation = {"eos_token_id": TINY_CONFIG["eos_token_id"], "pad_token_id": 256}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(tiny_weights(), str(folder / "model.safetensors"), metadata={"format": "pt"})
    save_byte_tokenizer(folder)


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """Path of the tiny model under ``cache_dir`` (default ~/.cache/kvpilot/models), made once."""
    root = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser()
    final = root / TINY_NAME
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{TINY_NAME}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        write_tiny_model(staging)
        try:
            staging.rename(final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final
