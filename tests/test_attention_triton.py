"""The Triton paged-attention kernels against the reference backend.

Without a GPU they run under Triton's interpreter (``TRITON_INTERPRET=1``, set here before
Triton is imported) on CPU tensors, with small shapes; on a CUDA machine on the device.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, given, settings

from kvpilot.engine.executor import SeqWork
from kvpilot.model.attention import TorchAttention, make_attention_backend
from kvpilot.model.attention.triton import TritonAttention, choose_splits
from kvpilot.model.runner import ModelRunner

from attention_cases import AttentionCase, attention_cases, run_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=attention_cases(max_dim=32))
def test_triton_kernel_matches_the_reference_on_random_steps(case: AttentionCase) -> None:
    expected, expected_pool = run_case(TorchAttention(), case, device=DEVICE)
    out, pool = run_case(TritonAttention(), case, device=DEVICE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool, expected_pool)


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 50])
def test_split_decode_matches_the_reference(splits: int, window: int | None) -> None:
    case = AttentionCase(8, 2, 32, 16, window, ((170, 1), (13, 1), (0, 1), (64, 1)), seed=3)
    expected, _ = run_case(TorchAttention(), case, device=DEVICE)
    out, _ = run_case(TritonAttention(num_splits=splits), case, device=DEVICE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "case",
    [
        AttentionCase(12, 4, 32, 4, None, ((40, 20), (5, 1))),  # prefill over a prefix, GQA 3
        AttentionCase(16, 2, 16, 8, 9, ((30, 17),)),  # group of 8 fills a whole tile
        AttentionCase(6, 3, 20, 2, None, ((11, 6), (7, 1))),  # head dim padded to 32
    ],
)
def test_prefill_chunks_over_a_cached_prefix_match_the_reference(case: AttentionCase) -> None:
    expected, _ = run_case(TorchAttention(), case, device=DEVICE)
    out, _ = run_case(TritonAttention(), case, device=DEVICE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_triton_kernel_in_bfloat16_is_close_to_the_reference() -> None:
    case = AttentionCase(8, 2, 32, 16, None, ((70, 1), (13, 5)))
    expected, _ = run_case(TorchAttention(), case, torch.bfloat16, DEVICE)
    out, _ = run_case(TritonAttention(), case, torch.bfloat16, DEVICE)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_runner_logits_on_the_triton_backend_equal_the_reference(
    hf_checkpoint: Callable[[str], Path], arch: str
) -> None:
    path = hf_checkpoint(arch)
    ref = ModelRunner(
        path, num_blocks=48, block_size=4, attention="torch", device=DEVICE, dtype="float32"
    )
    fast = ModelRunner(
        path, num_blocks=48, block_size=4, attention="triton", device=DEVICE, dtype="float32"
    )
    assert isinstance(fast.attention, TritonAttention)
    prompt = [(5 * j) % 250 + 3 for j in range(30)]
    tables = [list(range(0, 12)), list(range(12, 24))]
    steps = [
        [SeqWork(0, prompt[:13], 0, tables[0]), SeqWork(1, prompt[:4], 0, tables[1])],
        [SeqWork(0, prompt[13:29], 13, tables[0]), SeqWork(1, prompt[4:5], 4, tables[1])],
        [SeqWork(0, prompt[29:30], 29, tables[0]), SeqWork(1, prompt[5:6], 5, tables[1])],
    ]
    for works in steps:
        expected, got = ref.compute_logits(works), fast.compute_logits(works)
        for seq, logits in expected.items():
            torch.testing.assert_close(got[seq].cpu(), logits.cpu(), atol=1e-4, rtol=0)


def test_splits_fill_the_device_only_when_few_programs_run() -> None:
    assert choose_splits(num_works=64, num_kv_heads=8, max_context=32768, num_sms=132) == 1
    assert choose_splits(num_works=1, num_kv_heads=8, max_context=300, num_sms=132) == 1
    assert choose_splits(num_works=1, num_kv_heads=8, max_context=32768, num_sms=132) == 16
    assert choose_splits(num_works=2, num_kv_heads=4, max_context=2048, num_sms=132) == 4


def test_triton_is_chosen_by_name_under_the_interpreter() -> None:
    backend = make_attention_backend("triton", DEVICE)
    assert isinstance(backend, TritonAttention)
