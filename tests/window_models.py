"""Hybrid sliding-window checkpoints and helpers for the window-release tests.

Two tiny context-sensitive checkpoints (the factories of `kvpilot.model.checkpoints`) with a
window of W = 32 tokens, run on contexts four to six windows long:

- ``mistral``: every layer windowed (Mistral's own config: ``sliding_window``);
- ``qwen3``: mixed layers by ``layer_types`` (full, sliding, sliding).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch

from kvpilot.engine import Engine, SamplingParams
from kvpilot.model.checkpoints import make_checkpoint

WINDOW = 32
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
HF_ATOL = 2e-4  # fp32 logits against transformers' own forward

HYBRIDS = {
    "mistral": {"sliding_window": WINDOW},
    "qwen3": {
        "num_hidden_layers": 3,
        "use_sliding_window": True,
        "sliding_window": WINDOW,
        "max_window_layers": 1,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
    },
}


def build_hybrid(arch: str, root: Path) -> Path:
    return make_checkpoint(arch, root / f"{arch}-w{WINDOW}", seed=3, **HYBRIDS[arch])


def long_prompts(n: int, seed: int, lo: int = 4 * WINDOW, hi: int = 6 * WINDOW) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


_HF: dict[Path, object] = {}


def hf_logits(path: Path, tokens: Sequence[int]) -> torch.Tensor:
    """transformers' fp32 logits [len(tokens), vocab] of one sequence (its own masks)."""
    from transformers import AutoModelForCausalLM

    if path not in _HF:
        _HF[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = _HF[path]
    with torch.inference_mode():
        out = model(torch.tensor([list(tokens)]))  # type: ignore[operator]
    return out.logits[0].float()


def assert_matches_transformers(
    path: Path, prompt: Sequence[int], tokens: Sequence[int], logits: torch.Tensor
) -> None:
    """Greedy ``tokens`` sampled from ``logits`` are transformers' greedy continuation."""
    want = hf_logits(path, [*prompt, *tokens])[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    diff = float((logits - want).abs().max())
    assert diff <= HF_ATOL, f"logits differ from transformers by {diff:.3g}"
    assert list(tokens) == want.argmax(dim=-1).tolist()


def window_engine(path: Path, **options: object) -> Engine:
    settings: dict[str, object] = {"kv_blocks": 256, "block_size": 8}
    settings.update(options)
    return Engine.from_pretrained(str(path), **settings)


def held_window_blocks(engine: Engine) -> int:
    """Window-group blocks that running work holds (free and evictable cache excluded)."""
    window = engine.kv.window
    assert window is not None, "the engine kept no window group"
    return window.held_blocks()
