"""The built-in `tiny` model: generated once, deterministic, a real HF checkpoint."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from kvpilot.engine.executor import SeqWork
from kvpilot.model.loader import resolve_model_path
from kvpilot.model.runner import ModelRunner
from kvpilot.model.tiny import TINY_NAME, ensure_tiny_model
from kvpilot.model.tokenizer import SPECIAL_TOKENS, load_tokenizer


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_is_generated_once_and_reused(tiny_model_dir: Path) -> None:
    weights = tiny_model_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert ensure_tiny_model(tiny_model_dir.parent) == tiny_model_dir
    assert weights.stat().st_mtime_ns == stamp
    assert [p.name for p in tiny_model_dir.parent.iterdir()] == [TINY_NAME]


def test_tiny_weights_are_identical_across_generations(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    again = ensure_tiny_model(tmp_path)
    assert again != tiny_model_dir
    assert _sha256(again / "model.safetensors") == _sha256(tiny_model_dir / "model.safetensors")


def test_resolve_model_path_maps_tiny_to_the_cache(tiny_model_dir: Path) -> None:
    assert resolve_model_path("tiny", tiny_model_dir.parent) == tiny_model_dir


def test_tiny_loads_in_transformers_with_the_same_logits(tiny_model_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    runner = ModelRunner("tiny", num_blocks=8, cache_dir=tiny_model_dir.parent)
    assert not runner.config.tie_word_embeddings  # see kvpilot.model.tiny: tied, it was blind
    prompt = list(b"tiny models need no download")
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    ours = runner.compute_logits([SeqWork(0, prompt, 0, [0, 1])])[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_tiny_tokenizer_maps_each_byte_to_its_own_id(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    text = "héllo, wörld ✓\n\t"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 256 + len(SPECIAL_TOKENS)
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == tokenizer.eos_token_id == 256


def test_tiny_chat_template_marks_roles_with_special_tokens(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|system|>")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|end|>")) == 2


def test_tiny_stops_at_end_of_turn_and_end_of_text(tiny_model_dir: Path) -> None:
    runner = ModelRunner("tiny", num_blocks=4, cache_dir=tiny_model_dir.parent)
    end = runner.tokenizer.convert_tokens_to_ids("<|end|>")
    assert runner.eos_token_ids == (256, end)
