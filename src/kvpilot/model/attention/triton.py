"""The CUDA backend: Triton kernels that read K/V in place through block tables.

Decodes and prefill chunks over a cached prefix share one kernel
(`kvpilot.model.kernels.triton_attention`); decode-only steps with few (sequence, KV head)
pairs split each context across programs (flash-decoding). Under Triton's interpreter
(``TRITON_INTERPRET=1``) it also runs on CPU tensors, which is how CI tests it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvpilot.model.attention.base import AttentionBackend, write_kv
from kvpilot.model.batch import StepBatch
from kvpilot.model.kernels import triton_attention
from kvpilot.model.kv_cache import KVCache

SPLIT_MIN_KEYS = 512  # a context shorter than this is not worth splitting
MAX_SPLITS = 16


def choose_splits(num_works: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Programs per (sequence, KV head) for a decode-only step: enough to fill the device."""
    programs = num_works * num_kv_heads
    if programs >= num_sms or max_context < 2 * SPLIT_MIN_KEYS:
        return 1
    wanted = min(MAX_SPLITS, -(-num_sms // programs), max_context // SPLIT_MIN_KEYS)
    return 1 << (max(wanted, 1).bit_length() - 1)


@dataclass(frozen=True, slots=True)
class TritonStep:
    decode_only: bool
    num_sms: int


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        self.forced_splits = num_splits  # tests force a split count; None: choose per step

    def prepare(self, batch: StepBatch, windows: Iterable[int | None]) -> TritonStep:
        device = batch.query_start.device
        sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 1
        )
        return TritonStep(batch.max_query_len == 1, sms)

    def splits(self, batch: StepBatch, state: TritonStep, num_kv_heads: int) -> int:
        if not state.decode_only:
            return 1
        if self.forced_splits is not None:
            return self.forced_splits
        return choose_splits(batch.num_decodes, num_kv_heads, batch.max_context_len, state.num_sms)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        batch: StepBatch,
        state: object,
        window: int | None,
    ) -> torch.Tensor:
        assert isinstance(state, TritonStep)
        key_cache, value_cache = write_kv(cache, layer, k, v, batch.slot_mapping)
        return triton_attention.paged_attention(
            q,
            key_cache,
            value_cache,
            batch.query_start,
            batch.query_len,
            batch.context_len,
            batch.block_tables,
            batch.max_query_len,
            window,
            num_splits=self.splits(batch, state, key_cache.shape[2]),
        )
