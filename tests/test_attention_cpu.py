"""The CPU paged-attention kernel against the reference backend, and how backends are chosen."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kvpilot.engine.executor import SeqWork
from kvpilot.errors import ConfigError
from kvpilot.model.attention import TorchAttention, make_attention_backend
from kvpilot.model.attention.cpu import CpuPagedAttention
from kvpilot.model.checkpoints import ARCHITECTURES
from kvpilot.model.kernels import build
from kvpilot.model.runner import ModelRunner

from attention_cases import AttentionCase, attention_cases, run_case

ATOL = 1e-4


@pytest.fixture(scope="module")
def cpu_backend(tmp_path_factory: pytest.TempPathFactory) -> CpuPagedAttention:
    backend = make_attention_backend("cpu", kernel_cache=tmp_path_factory.mktemp("kernels"))
    assert isinstance(backend, CpuPagedAttention)
    return backend


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=attention_cases())
def test_cpu_kernel_matches_the_reference_on_random_steps(
    cpu_backend: CpuPagedAttention, case: AttentionCase
) -> None:
    expected, expected_pool = run_case(TorchAttention(), case)
    out, pool = run_case(cpu_backend, case)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool, expected_pool)


@pytest.mark.parametrize(
    "case",
    [
        # long decodes: several key chunks, so the online softmax rescales
        AttentionCase(8, 2, 64, 16, None, ((700, 1), (130, 1), (0, 1))),
        AttentionCase(8, 2, 64, 16, 100, ((700, 1), (130, 1))),
        # a long prefill chunk over a cached prefix, grouped heads tiled across items
        AttentionCase(12, 4, 32, 16, None, ((300, 70), (5, 1))),
        AttentionCase(16, 2, 128, 8, 40, ((90, 33),)),
        # head dims that are not multiples of 8 take the plain loops
        AttentionCase(6, 3, 20, 4, None, ((50, 9), (17, 1))),
    ],
)
def test_cpu_kernel_matches_the_reference_on_long_contexts(
    cpu_backend: CpuPagedAttention, case: AttentionCase
) -> None:
    expected, _ = run_case(TorchAttention(), case)
    out, _ = run_case(cpu_backend, case)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_cpu_kernel_in_bfloat16_is_close_to_float32(cpu_backend: CpuPagedAttention) -> None:
    case = AttentionCase(8, 2, 64, 16, None, ((200, 1), (64, 40), (3, 1)))
    expected, _ = run_case(TorchAttention(), case, dtype=torch.bfloat16)
    out, _ = run_case(cpu_backend, case, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def _works(prompts: list[list[int]], starts: list[int], per: int = 16) -> list[SeqWork]:
    return [
        SeqWork(i, p[s:], s, [i * per + b for b in range(per)])
        for i, (p, s) in enumerate(zip(prompts, starts, strict=True))
    ]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_runner_logits_on_the_cpu_backend_equal_the_reference(
    hf_checkpoint: Callable[[str], Path], arch: str
) -> None:
    path = hf_checkpoint(arch)
    ref = ModelRunner(path, num_blocks=64, block_size=4, attention="torch")
    fast = ModelRunner(path, num_blocks=64, block_size=4, attention="cpu")
    assert isinstance(fast.attention, CpuPagedAttention)
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((29, 41, 5, 17))]
    for runner in (ref, fast):  # cached prefixes of different lengths
        runner.compute_logits(
            _works([p[:c] for p, c in zip(prompts, (20, 33, 4, 1), strict=True)], [0] * 4)
        )
    # mixed step: two prefill chunks over cached prefixes, two decodes
    step = _works(prompts, [20, 33, 4, 16])
    step[3] = SeqWork(3, prompts[3][1:2], 1, step[3].block_table)
    expected, got = ref.compute_logits(step), fast.compute_logits(step)
    for seq in expected:
        torch.testing.assert_close(got[seq], expected[seq], atol=ATOL, rtol=0)
    decode = [
        SeqWork(i, [11 + i], len(p) if i != 3 else 2, step[i].block_table)
        for i, p in enumerate(prompts)
    ]
    expected, got = ref.compute_logits(decode), fast.compute_logits(decode)
    for seq in expected:
        torch.testing.assert_close(got[seq], expected[seq], atol=ATOL, rtol=0)


def test_auto_picks_the_cpu_kernel_on_cpu(tmp_path: Path) -> None:
    backend = make_attention_backend("auto", "cpu", torch.float32, kernel_cache=tmp_path)
    assert isinstance(backend, CpuPagedAttention)
    assert isinstance(make_attention_backend("torch"), TorchAttention)


def test_auto_falls_back_to_the_reference_without_a_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(build, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING):
        backend = make_attention_backend("auto", "cpu", kernel_cache=tmp_path / "none")
    assert isinstance(backend, TorchAttention)
    assert "no C++ compiler" in caplog.text
    with pytest.raises(ConfigError, match="no C\\+\\+ compiler"):
        make_attention_backend("cpu", kernel_cache=tmp_path / "none2")


def test_a_failed_build_is_reported_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "FLAGS", ("-fno-such-flag-for-kvpilot",))
    loaded = build.load_cpu_kernel(tmp_path)
    assert loaded.library is None
    assert "failed" in loaded.reason
    assert not list(tmp_path.rglob("*.so"))  # no half-written library left behind


def test_the_built_kernel_is_reused_from_its_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = build._load(tmp_path)
    assert first.library is not None and first.path is not None
    monkeypatch.setattr(build, "_build", lambda *a: pytest.fail("rebuilt a cached kernel"))
    again = build._load(tmp_path)
    assert again.path == first.path


def test_unsupported_choices_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="unknown attention backend"):
        make_attention_backend("flash")
    with pytest.raises(ConfigError, match="float32 or bfloat16"):
        make_attention_backend("cpu", "cpu", torch.float16)
    with pytest.raises(ConfigError, match="CUDA"):
        make_attention_backend("triton", "cpu")
    assert isinstance(make_attention_backend("auto", "cpu", torch.float16), TorchAttention)
