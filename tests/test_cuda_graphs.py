"""Decode graphs' static-buffer path (padding, the pad block, one packed upload).

Without CUDA the same path runs eagerly (``capture=False``); the capture itself runs only on
a CUDA machine (the last test, and scripts/gpu_check.sh).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvpilot.engine.executor import SeqWork
from kvpilot.errors import InvalidRequest
from kvpilot.model.cuda_graphs import DecodeGraphs, graph_batch_sizes
from kvpilot.model.runner import ModelRunner

BLOCKS = 40
BLOCK = 4


def _tables(n: int) -> list[list[int]]:
    return [[i + n * j for j in range(BLOCKS // n)] for i in range(n)]


def _prefill(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]]) -> None:
    runner.compute_logits(
        [SeqWork(i, p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    )


def test_graph_batch_sizes_cover_every_batch_up_to_the_maximum() -> None:
    assert graph_batch_sizes(128) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(1) == [1]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("n", [1, 3, 5])
def test_padded_static_decode_equals_the_eager_step(
    hf_checkpoint: Callable[[str], Path], arch: str, n: int
) -> None:
    path = hf_checkpoint(arch)
    eager = ModelRunner(path, num_blocks=BLOCKS, block_size=BLOCK, attention="torch")
    static = ModelRunner(path, num_blocks=BLOCKS + 1, block_size=BLOCK, attention="torch")
    graphs = DecodeGraphs(
        static.model,
        static.kv_cache,
        static.attention,
        pad_block=BLOCKS,
        max_batch=8,
        max_model_len=BLOCKS * BLOCK // n,
        capture=False,
    )
    prompts = [[(11 * i + 7 * j) % 250 + 3 for j in range(5 + 3 * i)] for i in range(n)]
    tables = _tables(n)
    _prefill(eager, prompts, tables)
    _prefill(static, prompts, tables)
    for step in range(3):
        works = [
            SeqWork(i, [40 + step + i], len(p) + step, t)
            for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
        ]
        expected = eager.compute_logits(works)
        got = graphs.run(works)
        for i in range(n):
            # fp32 logits within 1e-4 (the bound): a padded batch is another M for
            # the matmuls, which round differently
            torch.testing.assert_close(got[i], expected[i], atol=1e-4, rtol=0)
    # padding wrote only into the pad block (batched matmuls of another M round differently)
    real = eager.kv_cache.data[:, :, :BLOCKS]
    torch.testing.assert_close(static.kv_cache.data[:, :, :BLOCKS], real, atol=1e-5, rtol=0)


def test_static_decode_validates_like_the_eager_path(
    hf_checkpoint: Callable[[str], Path],
) -> None:
    runner = ModelRunner(hf_checkpoint("llama"), num_blocks=9, block_size=BLOCK)
    graphs = DecodeGraphs(
        runner.model, runner.kv_cache, runner.attention, pad_block=8, max_batch=4,
        max_model_len=32, capture=False,
    )  # fmt: skip
    assert graphs.handles([SeqWork(0, [1], 3, [0])])
    assert not graphs.handles([SeqWork(0, [1, 2], 3, [0])])
    with pytest.raises(InvalidRequest, match="block ids"):
        graphs.run([SeqWork(0, [1], 3, [8])])  # the pad block is not the engine's
    with pytest.raises(InvalidRequest, match="block table"):
        graphs.run([SeqWork(0, [1], 9, [0, 1])])
    with pytest.raises(InvalidRequest, match="token ids"):
        graphs.run([SeqWork(0, [300], 1, [0])])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_match_eager_decoding_on_cuda(hf_checkpoint: Callable[[str], Path]) -> None:
    path = hf_checkpoint("qwen3")
    eager = ModelRunner(path, num_blocks=BLOCKS, block_size=BLOCK, device="cuda",
                        dtype="float32", cuda_graphs=False)  # fmt: skip
    graphed = ModelRunner(path, num_blocks=BLOCKS, block_size=BLOCK, device="cuda",
                          dtype="float32")  # fmt: skip
    assert graphed.decode_graphs is not None
    prompts = [[(5 * i + j) % 250 + 3 for j in range(6 + i)] for i in range(3)]
    tables = _tables(3)
    _prefill(eager, prompts, tables)
    _prefill(graphed, prompts, tables)
    for step in range(4):
        works = [SeqWork(i, [9 + step], len(p) + step, t)
                 for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]  # fmt: skip
        expected, got = eager.compute_logits(works), graphed.compute_logits(works)
        for i in range(3):
            torch.testing.assert_close(got[i], expected[i], atol=1e-4, rtol=0)
    assert graphed.decode_graphs.graphs[4].graph is not None
