"""The engine on real checkpoints: outputs identical to transformers, and unchanged by every
cache decision (chunk, share, fork, preempt, keep across turns)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvpilot.engine import Engine, SamplingParams

from equivalence import LogitRecorder, Turn, assert_same_turns

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def prompts(n: int, seed: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_checked(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()


def generate_checked(
    engine: Engine, batch: list[list[int]], params: SamplingParams = GREEDY
) -> list[Turn]:
    """Each prompt's tokens and the fp32 logits they were sampled from."""
    return LogitRecorder(engine).generate(batch, params)


def tokens(turns: list[Turn]) -> list[list[int]]:
    return [list(t.tokens) for t in turns]


def assert_all_free(engine: Engine) -> None:
    for session in list(engine.sessions.values()):
        session.close()
    engine.kv.radix.evict(engine.kv.device.num_blocks)
    engine.check_invariants()
    assert engine.kv.device.num_free == engine.kv.device.num_blocks


def hf_greedy(path: Path, prompt: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = _hf_model(path)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    del AutoModelForCausalLM
    return out[0, len(prompt) :].tolist()


_HF: dict[Path, object] = {}


def _hf_model(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    if path not in _HF:
        _HF[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF[path]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_identical_to_transformers_generate(
    arch: str, hf_checkpoint: Callable[[str], Path]
) -> None:
    path = hf_checkpoint(arch)
    engine = Engine.from_pretrained(str(path), kv_blocks=256, max_prefill_chunk=32)
    batch = prompts(5, seed=hash(arch) % 1000)
    ours = tokens(generate_checked(engine, batch))
    for prompt, got in zip(batch, ours, strict=True):
        assert got == hf_greedy(path, prompt, GREEDY.max_tokens)
    assert_all_free(engine)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_path(request: pytest.FixtureRequest, hf_checkpoint: Callable[[str], Path]) -> Path:
    return hf_checkpoint(request.param)


def test_chunked_and_monolithic_prefill_identical(model_path: Path) -> None:
    batch = prompts(4, seed=1, lo=60, hi=150)
    chunked = Engine.from_pretrained(
        str(model_path), kv_blocks=256, max_prefill_chunk=16, max_num_batched_tokens=40
    )
    mono = Engine.from_pretrained(str(model_path), kv_blocks=256, chunked_prefill=False)
    assert_same_turns(generate_checked(chunked, batch), generate_checked(mono, batch))


def test_prefix_hit_identical_to_cold(model_path: Path) -> None:
    engine = Engine.from_pretrained(str(model_path), kv_blocks=256)
    system = prompts(1, seed=2, lo=70, hi=70)[0]
    tails = prompts(3, seed=3, lo=5, hi=20)
    cold = [
        generate_checked(Engine.from_pretrained(str(model_path), kv_blocks=256), [system + t])[0]
        for t in tails
    ]
    recorder = LogitRecorder(engine)
    warm = [recorder.generate([system + t], GREEDY)[0] for t in tails]
    assert_same_turns(warm, cold)
    assert engine.stats.cached_tokens == 2 * 64  # 70 shared tokens at B=16: four full blocks


def test_forked_branch_identical_to_independent_run(model_path: Path) -> None:
    engine = Engine.from_pretrained(str(model_path), kv_blocks=256)
    base = engine.open_session()
    first = prompts(1, seed=4, lo=37, hi=37)[0]
    out = base.generate(first, GREEDY)
    history = first + list(out.token_ids)
    branches = base.fork(3)
    suffixes = prompts(3, seed=5, lo=4, hi=9)
    recorder = LogitRecorder(engine)
    for branch, suffix in zip(branches, suffixes, strict=True):
        got = recorder.finish(branch.submit(suffix, GREEDY))
        solo = Engine.from_pretrained(str(model_path), kv_blocks=256)
        assert_same_turns([got], generate_checked(solo, [history + suffix]))
        engine.check_invariants()
    assert_all_free(engine)


def test_n_branches_share_one_prefill(model_path: Path) -> None:
    engine = Engine.from_pretrained(str(model_path), kv_blocks=256)
    prompt = prompts(1, seed=6, lo=40, hi=40)[0]
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=11, n=3, ignore_eos=True)
    out = engine.generate([prompt], params)[0]
    assert engine.stats.prefill_tokens == len(prompt)
    for branch in out.outputs:
        solo = Engine.from_pretrained(str(model_path), kv_blocks=256)
        single = SamplingParams(
            max_tokens=6, temperature=0.8, seed=11 + branch.index, ignore_eos=True
        )
        assert list(branch.token_ids) == tokens(generate_checked(solo, [prompt], single))[0]


def test_preempted_and_recomputed_identical(model_path: Path) -> None:
    batch = prompts(8, seed=7, lo=30, hi=60)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    tight = Engine.from_pretrained(str(model_path), kv_blocks=14)
    roomy = Engine.from_pretrained(str(model_path), kv_blocks=512)
    assert_same_turns(
        generate_checked(tight, batch, params), generate_checked(roomy, batch, params)
    )
    assert tight.scheduler.num_preemptions > 0
    assert_all_free(tight)


def test_session_turn_identical_to_whole_history(model_path: Path) -> None:
    engine = Engine.from_pretrained(str(model_path), kv_blocks=256)
    session = engine.open_session()
    recorder = LogitRecorder(engine)
    history: list[int] = []
    for turn, new in enumerate(prompts(3, seed=8, lo=10, hi=30)):
        rid = session.submit(new, GREEDY)
        request = engine.requests[rid]
        got = recorder.finish(rid)
        history += new
        solo = Engine.from_pretrained(str(model_path), kv_blocks=256)
        assert_same_turns([got], generate_checked(solo, [history]))
        if turn:
            assert request.cached_tokens == len(history) - len(new) - 1
        history += list(got.tokens)
    assert_all_free(engine)


def test_text_prompts_are_tokenized_and_decoded(tiny_model_dir: Path) -> None:
    engine = Engine.from_pretrained(str(tiny_model_dir), kv_blocks=128)
    out = engine.generate(["Hello"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.prompt_tokens == len(engine.tokenizer.encode("Hello"))
    assert len(out.token_ids) == 12
    assert out.text == engine.tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
