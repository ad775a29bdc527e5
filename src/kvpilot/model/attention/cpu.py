"""The CPU backend: paged attention in a small C++/OpenMP kernel that reads K/V in place.

Every work (decodes and prefill chunks alike) goes to one kernel call per layer: each query
walks its own sequence's block table, so no padded context is ever gathered. The kernel
(`kvpilot/model/kernels/paged_attention.cpp`) is compiled on first use; see
`kvpilot.model.kernels.build`. float32 and bfloat16 pools.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvpilot.errors import ConfigError
from kvpilot.model.attention.base import AttentionBackend, write_kv
from kvpilot.model.batch import StepBatch
from kvpilot.model.kv_cache import KVCache

KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True, slots=True)
class WorkPointers:
    """Addresses of one step's per-work int64 metadata (CPU tensors kept alive here)."""

    tensors: tuple[torch.Tensor, ...]
    query_start: int
    query_len: int
    context_len: int
    block_tables: int
    table_stride: int
    num_works: int

    @classmethod
    def of(
        cls,
        query_start: torch.Tensor,
        query_len: torch.Tensor,
        context_len: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> WorkPointers:
        parts = tuple(
            t.to(torch.int64).contiguous()
            for t in (query_start, query_len, context_len, block_tables)
        )
        return cls(
            tensors=parts,
            query_start=parts[0].data_ptr(),
            query_len=parts[1].data_ptr(),
            context_len=parts[2].data_ptr(),
            block_tables=parts[3].data_ptr(),
            table_stride=int(parts[3].shape[1]) if parts[3].dim() == 2 else 0,
            num_works=int(parts[0].shape[0]),
        )


def paged_attention(
    library: ctypes.CDLL,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    works: WorkPointers,
    window: int | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D], pools [num_blocks, B, H_kv, D] -> out [T, H, D] (keys already written)."""
    code = KERNEL_DTYPES.get(q.dtype)
    if code is None or key_cache.dtype != q.dtype:
        raise ConfigError(f"the cpu attention kernel takes float32 or bfloat16, got {q.dtype}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ConfigError("the cpu attention kernel needs contiguous K/V pools")
    q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    status = library.kvpilot_paged_attention(
        code,
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        out.data_ptr(),
        works.query_start,
        works.query_len,
        works.context_len,
        works.block_tables,
        works.table_stride,
        works.num_works,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        window or 0,
        head_dim**-0.5,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ConfigError(
            f"the cpu attention kernel rejected the shapes (status {status}): {num_heads} "
            f"heads over {num_kv_heads} KV heads of dim {head_dim}; use attention='torch'"
        )
    return out


class CpuPagedAttention(AttentionBackend):
    name = "cpu"

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library

    def prepare(self, batch: StepBatch, windows: Iterable[int | None]) -> WorkPointers:
        return WorkPointers.of(
            batch.query_start, batch.query_len, batch.context_len, batch.block_tables
        )

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
        assert isinstance(state, WorkPointers)
        key_cache, value_cache = write_kv(cache, layer, k, v, batch.slot_mapping)
        return paged_attention(self.library, q, key_cache, value_cache, state, window)
