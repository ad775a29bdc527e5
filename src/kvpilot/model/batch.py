"""`StepBatch`: one step's works flattened into index tensors, built once per step.

All works' tokens form one flat batch of T tokens (no padding) for the linear layers. Works
with a single token ("decodes": a decode step, or a one-token chunk) are grouped for one
batched attention call; longer chunks ("prefills") are attended one by one::

    flat tokens   | d0 | p0 p0 p0 p0 | d1 | p1 p1 |      works in the order given
    positions     | 37 | 16 17 18 19 | 5  |  0  1 |      start_pos .. start_pos + n - 1
    slot_mapping  | block_table[p // B] * B + p % B

Per work, the paged backends read ``query_start``/``query_len``/``context_len`` and one
padded ``block_tables`` row (context_len = start_pos + query_len: the keys it sees, its own
included). Every index tensor of a step arrives on the device in one transfer (`upload`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.engine.executor import SeqWork
from kvpilot.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """A multi-token chunk: flat tokens [token_start, token_start + num_tokens)."""

    token_start: int
    num_tokens: int
    start_pos: int
    block_ids: torch.Tensor  # blocks covering positions 0 .. start_pos + num_tokens - 1

    @property
    def context_len(self) -> int:
        return self.start_pos + self.num_tokens


@dataclass(frozen=True, slots=True)
class StepBatch:
    num_tokens: int
    block_size: int
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    last_token_index: torch.Tensor  # [n_works]: flat index of each work's last token
    decode_token_index: torch.Tensor | None  # [n_dec]; None when every token is a decode
    decode_positions: torch.Tensor  # [n_dec]
    decode_block_tables: torch.Tensor  # [n_dec, max_blocks], padded with block 0
    prefills: tuple[PrefillChunk, ...]
    query_start: torch.Tensor  # [n_works]: flat index of each work's first token
    query_len: torch.Tensor  # [n_works]
    context_len: torch.Tensor  # [n_works]: start_pos + query_len
    block_tables: torch.Tensor  # [n_works, max_blocks], padded with block 0
    max_query_len: int
    max_context_len: int
    logits_index: torch.Tensor  # [n_sampled]: flat rows whose logits are wanted

    @property
    def num_decodes(self) -> int:
        return int(self.decode_positions.shape[0])

    @classmethod
    def build(
        cls,
        works: Sequence[SeqWork],
        *,
        block_size: int,
        num_blocks: int,
        vocab_size: int,
        max_model_len: int,
        device: torch.device,
        wanted: Sequence[int] | None = None,
        uploader: Callable[[list[np.ndarray]], list[torch.Tensor]] | None = None,
    ) -> StepBatch:
        """``wanted``: indices of the works whose last-token logits are needed (default all).

        ``uploader`` moves the index arrays to the device in one transfer (default `upload`).
        """
        # Hot path: plain Python per work (a step is mostly one-token decodes), numpy after.
        flat_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_index: list[int] = []
        dec_index: list[int] = []
        dec_pos: list[int] = []
        dec_tables: list[Sequence[int]] = []
        prefill_specs: list[tuple[int, int, int, np.ndarray]] = []
        q_starts: list[int] = []
        q_lens: list[int] = []
        ctx_lens: list[int] = []
        tables: list[Sequence[int]] = []
        for work in works:
            n = len(work.token_ids)
            start = work.start_pos
            end = start + n
            if n == 0:
                raise InvalidRequest(f"seq {work.seq_id}: a work needs at least one token")
            if start < 0 or end > max_model_len:
                raise InvalidRequest(
                    f"seq {work.seq_id}: positions {start}..{end - 1} are outside the model "
                    f"context of {max_model_len} tokens"
                )
            need_blocks = -(-end // block_size)
            table = work.block_table[:need_blocks]
            if len(table) < need_blocks:
                raise InvalidRequest(
                    f"seq {work.seq_id}: block table has {len(work.block_table)} blocks, "
                    f"positions up to {end - 1} need {need_blocks} (block_size {block_size})"
                )
            q_starts.append(len(positions))
            q_lens.append(n)
            ctx_lens.append(end)
            tables.append(table)
            flat_ids.extend(work.token_ids)
            if n == 1:
                dec_index.append(len(positions))
                dec_pos.append(start)
                dec_tables.append(table)
                slots.append(table[start // block_size] * block_size + start % block_size)
                positions.append(start)
            else:
                table_arr = np.asarray(table, dtype=np.int64)
                prefill_specs.append((len(positions), n, start, table_arr))
                pos = np.arange(start, end, dtype=np.int64)
                slots.extend(
                    (table_arr[pos // block_size] * block_size + pos % block_size).tolist()
                )
                positions.extend(range(start, end))
            last_index.append(len(positions) - 1)

        offset = len(positions)
        ids_arr = np.asarray(flat_ids, dtype=np.int64)
        if ids_arr.min() < 0 or ids_arr.max() >= vocab_size:
            raise InvalidRequest(
                f"token ids must lie in [0, {vocab_size}), got {ids_arr.min()}..{ids_arr.max()}"
            )
        dec_table_arr = _padded(dec_tables)
        table_arr = _padded(tables)
        slots_arr = np.asarray(slots, dtype=np.int64)
        if table_arr.size and (table_arr.min() < 0 or table_arr.max() >= num_blocks):
            raise InvalidRequest(
                f"block ids must lie in [0, {num_blocks}), got {table_arr.min()}..{table_arr.max()}"
            )

        host = [
            ids_arr,
            np.asarray(positions, dtype=np.int64),
            slots_arr,
            np.asarray(last_index, dtype=np.int64),
            np.asarray(dec_index, dtype=np.int64),
            np.asarray(dec_pos, dtype=np.int64),
            dec_table_arr.reshape(-1),
            np.asarray(q_starts, dtype=np.int64),
            np.asarray(q_lens, dtype=np.int64),
            np.asarray(ctx_lens, dtype=np.int64),
            table_arr.reshape(-1),
            np.asarray(last_index if wanted is None else [last_index[i] for i in wanted]),
            *(spec[3] for spec in prefill_specs),
        ]
        on_device = uploader(host) if uploader is not None else upload(host, device)
        all_decodes = len(dec_index) == offset
        prefills = tuple(
            PrefillChunk(token_start=s[0], num_tokens=s[1], start_pos=s[2], block_ids=blocks)
            for s, blocks in zip(prefill_specs, on_device[12:], strict=True)
        )
        return cls(
            num_tokens=offset,
            block_size=block_size,
            input_ids=on_device[0],
            positions=on_device[1],
            slot_mapping=on_device[2],
            last_token_index=on_device[3],
            decode_token_index=None if all_decodes else on_device[4],
            decode_positions=on_device[5],
            decode_block_tables=on_device[6].view(dec_table_arr.shape),
            prefills=prefills,
            query_start=on_device[7],
            query_len=on_device[8],
            context_len=on_device[9],
            block_tables=on_device[10].view(table_arr.shape),
            max_query_len=max(q_lens),
            max_context_len=max(ctx_lens),
            logits_index=on_device[11],
        )


def _padded(tables: Sequence[Sequence[int]]) -> np.ndarray:
    width = max((len(t) for t in tables), default=0)
    out = np.zeros((len(tables), width), dtype=np.int64)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return out


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Copy int64 arrays to the device in one transfer, returned as views of one buffer.

    On CUDA the packed array is staged in pinned memory and copied without blocking the
    host (the caching host allocator keeps the staging buffer alive until the copy is done).
    """
    sizes = [a.size for a in arrays]
    packed = torch.from_numpy(np.concatenate(arrays).astype(np.int64, copy=False))
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    else:
        packed = packed.to(device)
    return list(torch.split(packed, sizes))
