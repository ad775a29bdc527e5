"""Tensor parallelism on CPU (gloo): TP=2 computes the logits TP=1 does, and fails loudly.

The models are the context-sensitive test checkpoints (tests/test_sensitivity.py), so a
wrong all-reduce, a wrong KV head or a mis-gathered vocabulary shard changes the logits.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpilot.engine.executor import SeqWork
from kvpilot.errors import ConfigError, TensorParallelError
from kvpilot.model.checkpoints import make_checkpoint
from kvpilot.model.parallel.executor import TensorParallelExecutor
from kvpilot.model.runner import ModelRunner

ATOL = 1e-4
PROMPT_A = [(7 * i + 3) % 240 + 5 for i in range(50)]
PROMPT_B = [(11 * i + 1) % 240 + 5 for i in range(12)]

# Each architecture once; llama and mistral with one KV head (fewer than the degree: it is
# replicated), qwen3 with a vocabulary the degree does not divide (a short last shard).
CASES = {
    "llama": {"num_key_value_heads": 1},
    "qwen2": {},
    "qwen3": {"vocab_size": 301},
    "mistral": {"num_key_value_heads": 1},
}


def steps() -> list[list[SeqWork]]:
    """Chunked prefills, a mixed batch, then decodes of two sequences."""
    a, b = [0, 1, 2, 3], [6, 7]
    return [
        [SeqWork(0, PROMPT_A[:30], 0, a), SeqWork(1, PROMPT_B[:9], 0, b)],
        [SeqWork(0, PROMPT_A[30:45], 30, a), SeqWork(1, PROMPT_B[9:10], 9, b)],
        [SeqWork(1, PROMPT_B[10:11], 10, b), SeqWork(0, PROMPT_A[45:46], 45, a)],
        [SeqWork(0, PROMPT_A[46:47], 46, a), SeqWork(1, PROMPT_B[11:12], 11, b)],
    ]


def tp_executor(path: Path, **options: object) -> TensorParallelExecutor:
    return TensorParallelExecutor(path, 2, num_blocks=12, block_size=16, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", sorted(CASES))
def test_tp2_logits_equal_tp1(arch: str, tmp_path: Path) -> None:
    path = make_checkpoint(arch, tmp_path / arch, **CASES[arch])
    reference = ModelRunner(path, num_blocks=12, block_size=16)
    with tp_executor(path) as tp:
        assert tp.num_blocks == 12
        for i, works in enumerate(steps()):
            want = reference.compute_logits(works)
            got = tp.compute_logits(works)
            for seq, row in want.items():
                assert got[seq].shape == row.shape
                diff = float((got[seq] - row).abs().max())
                assert diff <= ATOL, f"step {i}, seq {seq}: logits differ by {diff:.3g}"


@pytest.fixture
def running(hf_checkpoint: Callable[[str], Path]) -> Iterator[TensorParallelExecutor]:
    tp = tp_executor(hf_checkpoint("llama"), timeout_s=3.0)
    tp.compute_logits(steps()[0])
    yield tp
    tp.close()


def test_a_killed_worker_fails_the_executor_with_a_clear_error(
    running: TensorParallelExecutor,
) -> None:
    pid = running.worker_pids[0]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 .* exited with code -9.*restart"):
        running.compute_logits(steps()[1])
    assert time.monotonic() - start < 10.0
    with pytest.raises(TensorParallelError, match="rank 1"):  # and stays failed
        running.execute(steps()[1])


def test_a_worker_that_stops_answering_times_out_instead_of_hanging(
    running: TensorParallelExecutor,
) -> None:
    pid = running.worker_pids[0]
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # alive, but silent
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"did not answer within 3 s"):
        running.compute_logits(steps()[1])
    assert time.monotonic() - start < 30.0
    assert all(not w.process.is_alive() for w in running._workers)  # stopped, not left behind


def test_close_stops_the_workers(hf_checkpoint: Callable[[str], Path]) -> None:
    tp = tp_executor(hf_checkpoint("qwen2"))
    processes = [w.process for w in tp._workers]
    tp.close()
    assert all(p.exitcode == 0 for p in processes)
    with pytest.raises(TensorParallelError, match="closed"):
        tp.compute_logits(steps()[0])


def test_tp_refuses_a_degree_the_model_cannot_split(hf_checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(ConfigError, match=r"use one of \[1, 2, 4\]"):
        TensorParallelExecutor(hf_checkpoint("llama"), 3, num_blocks=4)
