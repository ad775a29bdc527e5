"""The pure-torch reference backend: portable (CPU and CUDA), the one others are tested against.

It gathers each step's contexts into dense tensors and calls SDPA:

- decodes (one query each) are batched: their blocks are gathered into a padded
  [n, max_blocks * B] context with a length mask, one SDPA call for all of them; the
  gathered slots past each context (its last block's unwritten tail, padding blocks) may
  hold anything, NaN included (freed blocks are poisoned in tests), so they are zeroed
  (from the shortest context on): a masked score still multiplies its value by 0, and
  0 * NaN is NaN;
- a prefill chunk attends to its cached prefix, read through its block table, plus itself
  causally (query i of a chunk starting at s sees keys 0 .. s + i).

With a sliding window W, a query at position p also ignores keys at positions <= p - W.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpilot.model.attention.base import AttentionBackend, write_kv
from kvpilot.model.batch import PrefillChunk, StepBatch
from kvpilot.model.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    masks: dict[int | None, torch.Tensor | None]  # None mask: plain causal over fresh K/V

    @classmethod
    def of(
        cls, chunk: PrefillChunk, windows: Iterable[int | None], device: torch.device
    ) -> ChunkPlan:
        masks: dict[int | None, torch.Tensor | None] = {}
        query = torch.arange(chunk.start_pos, chunk.context_len, device=device)[:, None]
        keys = torch.arange(chunk.context_len, device=device)[None, :]
        for window in windows:
            if window is None and chunk.start_pos == 0:
                masks[window] = None
                continue
            mask = keys <= query
            if window is not None:
                mask = mask & (keys > query - window)
            masks[window] = mask[None, None]
        return cls(masks)


def attend_chunk(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    chunk: PrefillChunk,
    mask: torch.Tensor | None,
) -> None:
    """Rows of one prefill chunk into ``out``: SDPA over its context (gathered once)."""
    rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
    if mask is None:
        chunk_k, chunk_v = k[rows], v[rows]
    else:
        chunk_k = _gather_context(key_cache, chunk.block_ids, chunk.context_len)
        chunk_v = _gather_context(value_cache, chunk.block_ids, chunk.context_len)
    groups = q.shape[1] // chunk_k.shape[1]
    expand = mask is not None and q.is_cuda and groups > 1
    if expand:
        # CUDA kernels that take a mask do not take grouped K/V: expand heads.
        chunk_k = chunk_k.repeat_interleave(groups, dim=1)
        chunk_v = chunk_v.repeat_interleave(groups, dim=1)
    attended = F.scaled_dot_product_attention(
        q[rows].transpose(0, 1).unsqueeze(0),
        chunk_k.transpose(0, 1).unsqueeze(0),
        chunk_v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=not expand,
    )
    out[rows] = attended[0].transpose(0, 1)


@dataclass(frozen=True, slots=True)
class _TorchStepState:
    decode_masks: dict[int | None, torch.Tensor]  # [n_dec, 1, 1, max_blocks * B]
    # Gathered slots that may lie past a decode's context: from column outside_from on,
    # outside[:, j] says which ([n_dec, width - outside_from, 1, 1]).
    outside_from: int
    outside: torch.Tensor | None
    chunks: tuple[ChunkPlan, ...]


class TorchAttention(AttentionBackend):
    """Portable backend (CPU and CUDA) built on `scaled_dot_product_attention`."""

    name = "torch"

    def prepare(self, batch: StepBatch, windows: Iterable[int | None]) -> _TorchStepState:
        windows = tuple(dict.fromkeys(windows))
        decode_masks: dict[int | None, torch.Tensor] = {}
        outside, outside_from = None, 0
        if batch.num_decodes:
            width = batch.decode_block_tables.shape[1] * batch.block_size
            keys = torch.arange(width, device=batch.positions.device)[None, :]
            query = batch.decode_positions[:, None]
            visible = keys <= query
            if not query.is_cuda:  # the shortest context, without a device sync on CUDA
                outside_from = int(query.min()) + 1
            outside = ~visible[:, outside_from:, None, None]
            for window in windows:
                mask = visible if window is None else visible & (keys > query - window)
                decode_masks[window] = mask[:, None, None, :]
        device = batch.positions.device
        chunks = tuple(ChunkPlan.of(chunk, windows, device) for chunk in batch.prefills)
        return _TorchStepState(decode_masks, outside_from, outside, chunks)

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
        assert isinstance(state, _TorchStepState)
        key_cache, value_cache = write_kv(cache, layer, k, v, batch.slot_mapping)

        if batch.decode_token_index is None:
            return self._decode(q, key_cache, value_cache, batch, state, window)
        out = torch.empty_like(q)
        if batch.num_decodes:
            index = batch.decode_token_index
            decoded = self._decode(
                q.index_select(0, index), key_cache, value_cache, batch, state, window
            )
            out.index_copy_(0, index, decoded)
        for chunk, plan in zip(batch.prefills, state.chunks, strict=True):
            attend_chunk(out, q, k, v, key_cache, value_cache, chunk, plan.masks[window])
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: StepBatch,
        state: _TorchStepState,
        window: int | None,
    ) -> torch.Tensor:
        n, num_heads, head_dim = q.shape
        num_kv_heads = key_cache.shape[2]
        tables = batch.decode_block_tables
        width = tables.shape[1] * batch.block_size
        flat_tables = tables.view(-1)
        # index_select copies whole blocks; advanced indexing is ~5x slower on CPU.
        keys = key_cache.index_select(0, flat_tables).view(n, width, num_kv_heads, head_dim)
        values = value_cache.index_select(0, flat_tables).view(n, width, num_kv_heads, head_dim)
        assert state.outside is not None
        start = state.outside_from
        keys[:, start:].masked_fill_(state.outside, 0.0)
        values[:, start:].masked_fill_(state.outside, 0.0)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        # One query per sequence: the G query heads sharing a KV head ride in the
        # query-length dimension, so grouped-query attention needs no K/V expansion.
        grouped = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            grouped, keys, values, attn_mask=state.decode_masks[window]
        )
        return out.reshape(n, num_heads, head_dim)


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Positions 0 .. length - 1 of a sequence, [length, H_kv, D], through its block table."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    return cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:length]
