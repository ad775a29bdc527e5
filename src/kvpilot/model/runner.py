"""`ModelRunner`: the PyTorch executor. Runs a step's works on the paged KV pool and samples."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvpilot.engine.executor import SeqWork, StepOutput, WindowGroupSpec
from kvpilot.errors import ConfigError
from kvpilot.model.attention import make_attention_backend
from kvpilot.model.batch import StepBatch
from kvpilot.model.config import ModelConfig
from kvpilot.model.cuda_graphs import DecodeGraphs
from kvpilot.model.fingerprint import model_fingerprint
from kvpilot.model.kv_cache import KVCache, kv_bytes_per_block, num_blocks_for_memory
from kvpilot.model.llama import LlamaModel
from kvpilot.model.loader import LoadProgress, iter_weights, resolve_model_path
from kvpilot.model.memory_budget import (
    DEFAULT_CPU_KV_BYTES,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    cuda_kv_budget_bytes,
)
from kvpilot.model.sampler import Sampler, SampleRow
from kvpilot.model.tokenizer import load_tokenizer
from kvpilot.model.window_group import WindowGroup, has_window_group, split_kv_budget

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
MAX_GRAPH_BATCH = 128  # larger decode batches run eagerly


def parse_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """A dtype by name; ``auto`` is bfloat16 on CUDA and float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    dtype = DTYPES.get(name)
    if dtype is None:
        raise ConfigError(f"unknown dtype {name!r}; use one of auto, float32, bfloat16, float16")
    return dtype


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"unknown device {name!r}; use 'cpu' or 'cuda'") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available; use 'cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r} is not supported; use 'cpu' or 'cuda'")
    return device


class ModelRunner:
    """Implements `kvpilot.engine.executor.Executor` for Llama-family checkpoints.

    The KV pool holds ``num_blocks`` blocks of ``block_size`` tokens; give either
    ``num_blocks`` or ``kv_memory_bytes`` (default: 1 GiB on CPU; on CUDA what
    ``gpu_memory_utilization`` of the device leaves after the weights, see
    `kvpilot.model.memory_budget`). ``max_model_len`` is the longest sequence that fits both
    the model's positions and the pool. ``dtype`` ``auto`` is bfloat16 on CUDA, float32 on
    CPU. Weights load straight onto the device. On CUDA, decode-only steps replay CUDA
    graphs captured per padded batch size (``cuda_graphs=False``: always eager).

    Sliding-window layers (Mistral, Qwen2/Qwen3 hybrids) keep their KV in a pool of their
    own with ``release_window_blocks`` (the engine's builder turns it on, `RunnerConfig`):
    ``num_window_blocks`` blocks (default with ``num_blocks``: as many as the main pool,
    plus the null block; sized from memory: `split_kv_budget` for ``max_num_seqs``
    sequences and a step of ``max_num_batched_tokens``, the main pool the rest),
    and the engine releases the blocks wholly outside the window
    (`kvpilot.model.window_group`; every work then carries a window table). Off, every
    layer's KV is in the one pool. With a window group, decodes run eagerly (no CUDA
    graphs). The window group never moves between tiers, so a model with no full-attention
    layer at all keeps every layer in the one pool when it has host or disk tiers
    (``tiered``): the tiers would have nothing to hold.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        block_size: int = 16,
        dtype: str = "auto",
        device: str = "cpu",
        attention: str = "auto",
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        cuda_graphs: bool = True,
        cache_dir: Path | None = None,
        progress: LoadProgress | None = None,
        release_window_blocks: bool = False,
        num_window_blocks: int | None = None,
        tiered: bool = False,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
    ) -> None:
        if num_blocks is not None and kv_memory_bytes is not None:
            raise ConfigError("give num_blocks or kv_memory_bytes, not both")
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        self.device = parse_device(device)
        self.dtype = parse_dtype(dtype, self.device)
        self.path = resolve_model_path(model, cache_dir)
        self.config = ModelConfig.from_folder(self.path)
        self.attention = make_attention_backend(attention, self.device, self.dtype)
        if progress is not None:
            progress.step("tokenizer")
        self.tokenizer: Any = load_tokenizer(self.path)
        if progress is not None:
            progress.step("weights")
        weights = iter_weights(self.path, progress, self.device)
        self.model = LlamaModel(
            self.config, weights, self.device, self.dtype, ops=self.attention.ops
        )
        if progress is not None:
            progress.step("kv_pool")
        self.block_size = block_size
        self.fingerprint = model_fingerprint(self.path, self.config, self.dtype, block_size)
        windowed = release_window_blocks and has_window_group(self.config, tiered=tiered)
        window_blocks = num_window_blocks
        if num_blocks is None:
            budget = kv_memory_bytes or self._default_kv_bytes(gpu_memory_utilization)
            if windowed and num_window_blocks is None:
                split = split_kv_budget(
                    self.config,
                    budget,
                    block_size,
                    self.dtype,
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens,
                )
                num_blocks, window_blocks = split.main_blocks, split.window_blocks
            else:
                num_blocks = num_blocks_for_memory(self.config, budget, block_size, self.dtype)
        self.window: WindowGroup | None = None
        if windowed:
            self.window = WindowGroup(
                self.config, window_blocks or num_blocks + 1, block_size, self.dtype, self.device
            )
        graphs = cuda_graphs and self.device.type == "cuda" and self.window is None
        # With graphs, one extra block (never handed to the engine) absorbs padded rows.
        self.kv_cache = KVCache(
            self.config,
            num_blocks + int(graphs),
            block_size,
            self.dtype,
            self.device,
            num_layers=None if self.window is None else self.window.layers.num_full,
        )
        self.num_blocks = num_blocks
        self.max_model_len = min(self.config.max_position_embeddings, num_blocks * block_size)
        self.model.rope.ensure(min(self.max_model_len, 4096))
        self.decode_graphs: DecodeGraphs | None = None
        if graphs:
            self.decode_graphs = DecodeGraphs(
                self.model,
                self.kv_cache,
                self.attention,
                pad_block=num_blocks,
                max_batch=MAX_GRAPH_BATCH,
                max_model_len=self.max_model_len,
            )
        self.eos_token_ids = eos_token_ids(self.path, self.config, self.tokenizer)
        self.sampler = Sampler()

    @staticmethod
    def num_blocks_for_memory(
        config: ModelConfig, memory_bytes: int, block_size: int, dtype: str
    ) -> int:
        return num_blocks_for_memory(config, memory_bytes, block_size, parse_dtype(dtype))

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.config, self.block_size, self.dtype)

    @property
    def window_group(self) -> WindowGroupSpec | None:
        return None if self.window is None else self.window.spec

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def _default_kv_bytes(self, gpu_memory_utilization: float) -> int:
        if self.device.type == "cuda":
            return cuda_kv_budget_bytes(self.device, gpu_memory_utilization)
        return DEFAULT_CPU_KV_BYTES

    def _batch(self, works: Sequence[SeqWork], wanted: Sequence[int]) -> StepBatch:
        return StepBatch.build(
            works,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            vocab_size=self.config.vocab_size,
            max_model_len=self.max_model_len,
            device=self.device,
            wanted=wanted,
        )

    def _run(self, works: Sequence[SeqWork], wanted: Sequence[int]) -> torch.Tensor | None:
        """Compute KV for all works; fp32 last-position logits of the works at ``wanted``."""
        if self.decode_graphs is not None and self.decode_graphs.handles(works):
            logits = self.decode_graphs.run(works)
            if len(wanted) == len(works):
                return logits
            return logits[torch.tensor(list(wanted), device=self.device)] if wanted else None
        batch = self._batch(works, wanted)
        self.model.rope.ensure(batch.max_context_len)
        window = None
        if self.window is not None:
            window_batch = self.window.batch(
                works,
                batch,
                vocab_size=self.config.vocab_size,
                max_model_len=self.max_model_len,
                device=self.device,
                wanted=wanted,
            )
            window = (window_batch, self.window.cache)
        hidden = self.model.forward(batch, self.kv_cache, self.attention, window)
        if not wanted:
            return None
        return self.model.logits(hidden.index_select(0, batch.logits_index))

    @torch.inference_mode()
    def compute_logits(self, works: Sequence[SeqWork]) -> dict[int, torch.Tensor]:
        """fp32 logits of each work's last position, by seq_id (computes and stores KV too)."""
        return logits_by_seq(works, self._run)

    @torch.inference_mode()
    def execute(self, works: Sequence[SeqWork]) -> StepOutput:
        return sample_step(works, self._run, self.sampler)

    @torch.inference_mode()
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.kv_cache.copy_blocks(pairs)

    @torch.inference_mode()
    def poison_blocks(self, blocks: Sequence[int]) -> None:
        self.kv_cache.poison(blocks)

    @torch.inference_mode()
    def copy_window_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if self.window is not None:
            self.window.copy_blocks(pairs)

    @torch.inference_mode()
    def poison_window_blocks(self, blocks: Sequence[int]) -> None:
        if self.window is not None:
            self.window.poison(blocks)


def eos_token_ids(path: Path, config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """The config's, the tokenizer's and generation_config.json's end-of-sequence ids."""
    ids = list(config.eos_token_ids)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tokenizer_eos, int):
        ids.append(tokenizer_eos)
    generation = path / "generation_config.json"
    if generation.is_file():
        try:
            raw = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            raw = None
        values = raw if isinstance(raw, list) else [raw]
        ids.extend(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return tuple(dict.fromkeys(ids))


RunFn = Callable[[Sequence[SeqWork], Sequence[int]], "torch.Tensor | None"]


def logits_by_seq(works: Sequence[SeqWork], run: RunFn) -> dict[int, torch.Tensor]:
    """fp32 logits of each work's last position, by seq_id (``run`` computes KV too)."""
    if not works:
        return {}
    logits = run(works, range(len(works)))
    assert logits is not None
    return {work.seq_id: row for work, row in zip(works, logits, strict=True)}


def sample_step(works: Sequence[SeqWork], run: RunFn, sampler: Sampler) -> StepOutput:
    """One step of an executor: ``run`` computes KV and the logits of the works at the given
    indices (those that sample); ``sampler`` draws each one's tokens."""
    if not works:
        return StepOutput(tokens={})
    wanted = [i for i, w in enumerate(works) if w.sampling is not None]
    logits = run(works, wanted)
    if logits is None:
        return StepOutput(tokens={})
    rows: list[SampleRow] = []
    logit_rows: list[int] = []
    for row, i in enumerate(wanted):
        work = works[i]
        assert work.sampling is not None
        for branch in range(max(1, work.sample_count)):
            rows.append(SampleRow(work.sampling, work.seed + branch, work.step))
            logit_rows.append(row)
    if len(logit_rows) != len(wanted):
        logits = logits[torch.tensor(logit_rows, device=logits.device)]
    sampled = sampler.sample(logits, rows)
    tokens: dict[int, list[int]] = {}
    for row, token in zip(logit_rows, sampled, strict=True):
        tokens.setdefault(works[wanted[row]].seq_id, []).append(token)
    return StepOutput(tokens=tokens)
