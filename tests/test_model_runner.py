"""ModelRunner against transformers: logits, chunked prefill, batched decode, greedy generation."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.engine.executor import SeqWork
from kvpilot.engine.sampling import SamplingParams
from kvpilot.errors import ConfigError, InvalidRequest
from kvpilot.model.checkpoints import ARCHITECTURES, make_checkpoint
from kvpilot.model.runner import ModelRunner

ATOL = 1e-4  # fp32 logits (magnitude ~10-40) vs transformers: observed error ~1e-5
BLOCK = 4
PER_SEQ_BLOCKS = 32
PROMPTS = (
    [12, 200, 33, 4, 91, 17, 250, 8, 64, 3, 77, 120, 5],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [255, 0, 128],
    [42],
)


def _runner(path: Path, **kwargs: object) -> ModelRunner:
    options: dict[str, object] = {"num_blocks": 4 * PER_SEQ_BLOCKS, "block_size": BLOCK}
    options.update(kwargs)
    return ModelRunner(path, **options)  # type: ignore[arg-type]


def _table(slot: int) -> list[int]:
    """Sequence ``slot``'s blocks, deliberately non-contiguous and descending."""
    return [slot + 4 * (PER_SEQ_BLOCKS - 1 - i) for i in range(PER_SEQ_BLOCKS)]


def _work(seq: int, tokens: Sequence[int], start: int, **kwargs: object) -> SeqWork:
    return SeqWork(
        seq_id=seq, token_ids=list(tokens), start_pos=start, block_table=_table(seq), **kwargs
    )  # type: ignore[arg-type]


def _hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()


def _hf_last_logits(model: torch.nn.Module, tokens: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(tokens)])).logits[0, -1].float()


@pytest.fixture(params=ARCHITECTURES)
def arch_path(request: pytest.FixtureRequest, hf_checkpoint: Callable[[str], Path]) -> Path:
    return hf_checkpoint(request.param)


def test_prefill_last_logits_match_transformers(arch_path: Path) -> None:
    runner, hf = _runner(arch_path), _hf_model(arch_path)
    for seq, prompt in enumerate(PROMPTS):
        ours = runner.compute_logits([_work(seq, prompt, 0)])[seq]
        torch.testing.assert_close(ours, _hf_last_logits(hf, prompt), atol=ATOL, rtol=0)


def test_chunked_prefill_matches_monolithic(arch_path: Path) -> None:
    runner = _runner(arch_path)
    prompt = PROMPTS[1]
    whole = runner.compute_logits([_work(0, prompt, 0)])[0]
    runner.compute_logits([_work(1, prompt[:5], 0)])
    runner.compute_logits([_work(1, prompt[5:14], 5)])
    chunked = runner.compute_logits([_work(1, prompt[14:], 14)])[1]
    torch.testing.assert_close(chunked, whole, atol=ATOL, rtol=0)


def test_mixed_batch_of_decodes_and_a_prefill_chunk_matches_each_alone(arch_path: Path) -> None:
    alone_runner, batch_runner = _runner(arch_path), _runner(arch_path)
    prompts = PROMPTS[:3]
    for runner in (alone_runner, batch_runner):
        for seq, prompt in enumerate(prompts[:2]):
            runner.compute_logits([_work(seq, prompt[:-1], 0)])
        runner.compute_logits([_work(2, prompts[2][:1], 0)])
    steps = [
        _work(0, PROMPTS[0][-1:], len(PROMPTS[0]) - 1),
        _work(2, prompts[2][1:], 1),
        _work(1, PROMPTS[1][-1:], len(PROMPTS[1]) - 1),
    ]
    alone = {w.seq_id: alone_runner.compute_logits([w])[w.seq_id] for w in steps}
    batched = batch_runner.compute_logits(steps)
    for seq, logits in alone.items():
        torch.testing.assert_close(batched[seq], logits, atol=ATOL, rtol=0)


def _greedy_generate(
    runner: ModelRunner, prompts: Sequence[Sequence[int]], new_tokens: int
) -> list[list[int]]:
    """Prefill every prompt in one step, then decode all sequences together."""
    greedy = SamplingParams(max_tokens=new_tokens)
    works = [_work(s, p, 0, sampling=greedy) for s, p in enumerate(prompts)]
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(new_tokens):
        sampled = runner.execute(works).tokens
        for seq in range(len(prompts)):
            outputs[seq].extend(sampled[seq])
        works = [
            _work(s, [outputs[s][-1]], len(p) + step, sampling=greedy, step=step + 1)
            for s, p in enumerate(prompts)
        ]
    return outputs


@pytest.mark.parametrize("batch_size", [1, 3, 4])
def test_greedy_generation_matches_transformers_generate(arch_path: Path, batch_size: int) -> None:
    runner, hf = _runner(arch_path), _hf_model(arch_path)
    prompts = PROMPTS[:batch_size]
    ours = _greedy_generate(runner, prompts, new_tokens=12)
    for prompt, tokens in zip(prompts, ours, strict=True):
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
        assert tokens == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_tracks_float32_within_its_precision(
    hf_checkpoint: Callable[[str], Path], dtype: str
) -> None:
    """Teacher-forced on float32's greedy continuation: at every step the half-precision
    logits are within 2% of the logits' range, and its greedy choice is float32's or a near
    tie in float32 (the test models are context-sensitive, so a near tie may flip and then
    every later token differs: free-running continuations are not comparable)."""
    path = hf_checkpoint("llama")
    fp32 = _runner(path)
    half = _runner(path, dtype=dtype)
    steps = agree = 0
    for seq, prompt in enumerate(PROMPTS[:3]):
        tokens = [*prompt, *_greedy_generate(fp32, [prompt], 6)[0]]
        for end in range(len(prompt), len(tokens)):
            logits32 = fp32.compute_logits([_work(seq, tokens[:end], 0)])[seq]
            logits16 = half.compute_logits([_work(seq, tokens[:end], 0)])[seq]
            assert logits16.dtype == torch.float32
            tolerance = 0.02 * float(logits32.max() - logits32.min())
            torch.testing.assert_close(logits16, logits32, atol=tolerance, rtol=0)
            choice = int(logits16.argmax())
            assert logits32[choice] >= logits32.max() - tolerance
            steps += 1
            agree += choice == tokens[end]
    assert agree >= 0.8 * steps


def test_sliding_window_hides_keys_older_than_the_window(
    hf_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    windowed = _runner(make_checkpoint("mistral", tmp_path / "windowed", sliding_window=8))
    assert windowed.config.sliding_window == 8
    full = _runner(make_checkpoint("mistral", tmp_path / "full", sliding_window=None))
    short, long = PROMPTS[0][:8], PROMPTS[1]
    torch.testing.assert_close(
        windowed.compute_logits([_work(0, short, 0)])[0],
        full.compute_logits([_work(0, short, 0)])[0],
        atol=ATOL,
        rtol=0,
    )
    differ = (
        windowed.compute_logits([_work(1, long, 0)])[1]
        - full.compute_logits([_work(1, long, 0)])[1]
    )
    assert differ.abs().max() > 1e-2


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    cuts=st.lists(st.integers(1, 22), max_size=4, unique=True),
    order=st.permutations(list(range(6))),
)
def test_logits_do_not_depend_on_chunking_or_block_placement(
    hf_checkpoint: Callable[[str], Path], cuts: list[int], order: list[int]
) -> None:
    runner = _cached_runner(hf_checkpoint("qwen3"))
    prompt = PROMPTS[1]
    reference = runner.compute_logits([_work(0, prompt, 0)])[0]
    table = [b + 10 for b in order]
    bounds = [0, *sorted(cuts), len(prompt)]
    logits = None
    for start, end in itertools.pairwise(bounds):
        work = SeqWork(seq_id=9, token_ids=prompt[start:end], start_pos=start, block_table=table)
        logits = runner.compute_logits([work])[9]
    assert logits is not None
    torch.testing.assert_close(logits, reference, atol=ATOL, rtol=0)


_RUNNERS: dict[Path, ModelRunner] = {}


def _cached_runner(path: Path) -> ModelRunner:
    if path not in _RUNNERS:
        _RUNNERS[path] = _runner(path)
    return _RUNNERS[path]


def test_copy_blocks_copies_exactly_the_named_blocks(hf_checkpoint: Callable[[str], Path]) -> None:
    runner = _runner(hf_checkpoint("llama"), num_blocks=8)
    data = runner.kv_cache.data
    data.copy_(torch.randn(data.shape, generator=torch.Generator().manual_seed(0)))
    before = data.clone()
    runner.copy_blocks([(1, 5), (6, 2)])
    assert torch.equal(data[:, :, 5], before[:, :, 1])
    assert torch.equal(data[:, :, 2], before[:, :, 6])
    untouched = [0, 1, 3, 4, 6, 7]
    assert torch.equal(data[:, :, untouched], before[:, :, untouched])


def test_forked_sequence_decodes_like_its_parent_after_copy_on_write(
    hf_checkpoint: Callable[[str], Path],
) -> None:
    runner = _runner(hf_checkpoint("qwen2"), num_blocks=16)
    prompt = PROMPTS[0]  # 13 tokens: blocks 0..2 full, block 3 holds one token
    runner.compute_logits([SeqWork(0, prompt, 0, [0, 1, 2, 3])])
    runner.copy_blocks([(3, 7)])
    parent = runner.compute_logits([SeqWork(0, [9], 13, [0, 1, 2, 3])])[0]
    child = runner.compute_logits([SeqWork(1, [9], 13, [0, 1, 2, 7])])[1]
    torch.testing.assert_close(child, parent, atol=1e-5, rtol=0)


def test_execute_samples_only_for_works_that_ask(hf_checkpoint: Callable[[str], Path]) -> None:
    runner = _runner(hf_checkpoint("llama"))
    out = runner.execute(
        [_work(0, PROMPTS[0], 0), _work(1, PROMPTS[2], 0, sampling=SamplingParams())]
    )
    expected = int(runner.compute_logits([_work(2, PROMPTS[2], 0)])[2].argmax())
    assert out.tokens == {1: [expected]}


def test_sample_count_draws_one_token_per_branch_seed(hf_checkpoint: Callable[[str], Path]) -> None:
    runner = _runner(hf_checkpoint("llama"))
    params = SamplingParams(temperature=1.5)
    fanned = runner.execute([_work(0, PROMPTS[0], 0, sampling=params, seed=7, sample_count=4)])
    singles = [
        runner.execute([_work(1, PROMPTS[0], 0, sampling=params, seed=7 + i)]).tokens[1][0]
        for i in range(4)
    ]
    assert fanned.tokens[0] == singles


def test_sharded_checkpoint_loads_like_a_single_file(
    hf_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    sharded = make_checkpoint("llama", tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    ours = _runner(sharded).compute_logits([_work(0, PROMPTS[0], 0)])[0]
    single = _runner(hf_checkpoint("llama")).compute_logits([_work(0, PROMPTS[0], 0)])[0]
    torch.testing.assert_close(ours, single, atol=1e-5, rtol=0)


def test_block_table_too_short_is_rejected(hf_checkpoint: Callable[[str], Path]) -> None:
    runner = _runner(hf_checkpoint("llama"))
    with pytest.raises(InvalidRequest, match="block table"):
        runner.execute([SeqWork(0, PROMPTS[0], 0, [0, 1])])


def test_out_of_range_token_and_block_ids_are_rejected(
    hf_checkpoint: Callable[[str], Path],
) -> None:
    runner = _runner(hf_checkpoint("llama"), num_blocks=8)
    with pytest.raises(InvalidRequest, match="token ids"):
        runner.execute([SeqWork(0, [300], 0, [0])])
    with pytest.raises(InvalidRequest, match="block ids"):
        runner.execute([SeqWork(0, [1, 2], 0, [8])])
    with pytest.raises(InvalidRequest, match="destination"):
        runner.copy_blocks([(0, 1), (2, 1)])


def test_kv_pool_is_sized_from_a_memory_budget(hf_checkpoint: Callable[[str], Path]) -> None:
    path = hf_checkpoint("llama")
    per_block = 2 * 2 * 2 * BLOCK * 16 * 4  # 2 · L · H_kv · B · d_head · fp32
    runner = _runner(path, num_blocks=None, kv_memory_bytes=10 * per_block + 5)
    assert runner.kv_bytes_per_block == per_block
    assert runner.num_blocks == 10
    assert runner.max_model_len == 10 * BLOCK
    assert ModelRunner.num_blocks_for_memory(runner.config, 10 * per_block, BLOCK, "bfloat16") == 20
    assert runner.kv_cache.data.shape == (2, 2, 10, BLOCK, 2, 16)


def test_bad_runner_options_raise_config_errors(hf_checkpoint: Callable[[str], Path]) -> None:
    path = hf_checkpoint("llama")
    with pytest.raises(ConfigError, match="not both"):
        ModelRunner(path, num_blocks=4, kv_memory_bytes=1 << 20)
    with pytest.raises(ConfigError, match="attention backend"):
        ModelRunner(path, num_blocks=4, attention="flash-nonexistent")
    with pytest.raises(ConfigError, match="dtype"):
        ModelRunner(path, num_blocks=4, dtype="float8")
    with pytest.raises(ConfigError, match="holds no block"):
        ModelRunner(path, kv_memory_bytes=10)


def test_eos_ids_come_from_config_and_tokenizer(hf_checkpoint: Callable[[str], Path]) -> None:
    runner = _runner(hf_checkpoint("qwen3"))
    assert runner.eos_token_ids == (256, 261)
    assert runner.tokenizer.eos_token_id == 256


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_runner_matches_cpu(hf_checkpoint: Callable[[str], Path]) -> None:
    path = hf_checkpoint("mistral")
    cpu, cuda = _runner(path), _runner(path, device="cuda", dtype="float32")
    prompts = PROMPTS[:3]
    assert _greedy_generate(cuda, prompts, 8) == _greedy_generate(cpu, prompts, 8)
    ours = cuda.compute_logits([_work(3, PROMPTS[1], 0)])[3].cpu()
    torch.testing.assert_close(
        ours, cpu.compute_logits([_work(3, PROMPTS[1], 0)])[3], atol=1e-3, rtol=0
    )
    params = SamplingParams(temperature=1.0, top_p=0.9)
    work = _work(0, PROMPTS[0], 0, sampling=params, seed=3)
    assert cuda.execute([work]).tokens == cpu.execute([work]).tokens
