"""The side-by-side benchmark's checkpoints: random-init Llama shapes with a trained tokenizer.

Two sizes (the shapes of the decode figures in issue 17), written once under
``~/.cache/kvpilot/peers``. The tokenizer is a ByteLevel BPE trained with `tokenizers` on
local text (the agent traces and this repository's docs): no downloads, and real subword
token counts for the trace replay. Both kvpilot and vLLM load the folders as they are.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvpilot.model.checkpoints import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces" / "lmcache-agent-trace" / "miniswe"
CACHE = Path.home() / ".cache" / "kvpilot" / "peers"
VOCAB = 32000
EOS = "<|endoftext|>"

SHAPES: dict[str, dict[str, Any]] = {
    "19m": {
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    },
    "125m": {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
    },
}
MAX_POSITIONS = 4096


def _corpus() -> Iterator[str]:
    for path in sorted(TRACES.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                call = json.loads(line)
                yield call.get("input", "")
                yield call.get("output", "")
    for path in sorted(ROOT.glob("**/*.md")):
        if ".venv" not in path.parts:
            yield path.read_text(encoding="utf-8")


def train_tokenizer(folder: Path) -> None:
    """A ByteLevel BPE of up to `VOCAB` tokens, saved as a Hugging Face fast tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(_corpus(), vocab_size=VOCAB, min_frequency=2, special_tokens=[EOS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token=EOS, pad_token=EOS, bos_token=None
    )
    for stale in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / stale).unlink(missing_ok=True)
    fast.save_pretrained(str(folder))


def ensure_model(size: str) -> Path:
    """The ``size`` ("19m" or "125m") checkpoint folder, built on first use."""
    path = CACHE / f"llama-{size}"
    if (path / "tokenizer_config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    make_checkpoint(
        "llama",
        path,
        vocab_size=VOCAB,
        max_position_embeddings=MAX_POSITIONS,
        eos_token_id=0,
        pad_token_id=0,
        **SHAPES[size],
    )
    train_tokenizer(path)
    return path
