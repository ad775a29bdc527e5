"""CUDA graphs for decode-only steps: the step's Python and launch cost paid once per shape.

A decode-only step of n sequences runs as the graph of the smallest captured batch size
bs >= n (1, 2, 4, 8, then multiples of 16). Every input lives in static device buffers that
the graph reads; a step fills them with one host->device copy of one packed int64 array:

    packed | input_ids[bs] | positions[bs] | slots[bs] | context_len[bs] | tables[bs, W] |

Rows n .. bs-1 are padding: token 0 at position 0, context 1, a block table of the pad
block only, whose slot receives their K/V. The pad block is one extra block of the pool that
the engine never allocates, so padding never touches real KV. Captured shapes are fixed, so
attention uses a fixed split count per graph (chosen for the longest context) and the RoPE
table is built for the whole model length before the first capture.

``capture=False`` runs exactly the same static-buffer path eagerly (no graph): that is how
the padding and the buffer layout are tested on machines without CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvpilot.engine.executor import SeqWork
from kvpilot.errors import InvalidRequest
from kvpilot.model.attention import AttentionBackend
from kvpilot.model.batch import StepBatch
from kvpilot.model.kv_cache import KVCache
from kvpilot.model.llama import LlamaModel


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, max_batch, 16))
    return [*sizes, max_batch]


@dataclass(slots=True)
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph, or None when not capturing
    batch: StepBatch
    logits: torch.Tensor | None  # the graph's output [bs, vocab]


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        attention: AttentionBackend,
        *,
        pad_block: int,
        max_batch: int,
        max_model_len: int,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.cache = cache
        self.attention = attention
        self.pad_block = pad_block
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // self.block_size)
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.capture = capture
        self.device = cache.data.device
        per_row = 4 + self.width
        self.packed = torch.zeros(self.max_batch * per_row, dtype=torch.int64, device=self.device)
        self.host = torch.zeros(
            self.packed.shape, dtype=torch.int64, pin_memory=self.device.type == "cuda"
        )
        self.graphs: dict[int, _Captured] = {}
        self.pool: Any = None
        self._copied: Any = None  # CUDA event of the last upload (the host buffer is reused)
        model.rope.ensure(max_model_len)

    def handles(self, works: Sequence[SeqWork]) -> bool:
        return 0 < len(works) <= self.max_batch and all(len(w.token_ids) == 1 for w in works)

    def _views(self, bs: int) -> tuple[torch.Tensor, ...]:
        """input_ids, positions, slots, context_len [bs] and tables [bs, W] of size ``bs``."""
        m = self.max_batch
        flat = self.packed
        ids, pos, slots, ctx = (flat[i * m : i * m + bs] for i in range(4))
        tables = flat[4 * m :].view(m, self.width)[:bs]
        return ids, pos, slots, ctx, tables

    def _static_batch(self, bs: int) -> StepBatch:
        ids, pos, slots, ctx, tables = self._views(bs)
        rows = torch.arange(bs, device=self.device)
        return StepBatch(
            num_tokens=bs,
            block_size=self.block_size,
            input_ids=ids,
            positions=pos,
            slot_mapping=slots,
            last_token_index=rows,
            decode_token_index=None,
            decode_positions=pos,
            decode_block_tables=tables,
            prefills=(),
            query_start=rows,
            query_len=torch.ones(bs, dtype=torch.int64, device=self.device),
            context_len=ctx,
            block_tables=tables,
            max_query_len=1,
            max_context_len=self.max_model_len,
            logits_index=rows,
        )

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        hidden = self.model.forward(batch, self.cache, self.attention)
        return self.model.logits(hidden)

    def _validate(self, works: Sequence[SeqWork]) -> None:
        vocab = self.model.config.vocab_size
        for work in works:
            p = work.start_pos
            if not 0 <= p < self.max_model_len:
                raise InvalidRequest(
                    f"seq {work.seq_id}: position {p} is outside the model context of "
                    f"{self.max_model_len} tokens"
                )
            if not 0 <= work.token_ids[0] < vocab:
                raise InvalidRequest(f"token ids must lie in [0, {vocab}), got {work.token_ids[0]}")
            need = p // self.block_size + 1
            table = work.block_table[:need]
            if len(table) < need:
                raise InvalidRequest(
                    f"seq {work.seq_id}: block table has {len(work.block_table)} blocks, "
                    f"position {p} needs {need} (block_size {self.block_size})"
                )
            if min(table) < 0 or max(table) >= self.pad_block:
                raise InvalidRequest(f"block ids must lie in [0, {self.pad_block}), got {table}")

    def _fill(self, works: Sequence[SeqWork], bs: int) -> None:
        """Write the step's inputs (and padding) into the static buffers: one copy."""
        m, width, block = self.max_batch, self.width, self.block_size
        if self._copied is not None:
            self._copied.synchronize()  # the previous upload has left the host buffer
        host = self.host.numpy()
        ids, pos, slots, ctx = (host[i * m : i * m + bs] for i in range(4))
        tables = host[4 * m :].reshape(m, width)[:bs]
        ids[:] = 0
        pos[:] = 0
        ctx[:] = 1
        slots[:] = self.pad_block * block
        tables[:] = self.pad_block
        for row, work in enumerate(works):
            p = work.start_pos
            need = p // block + 1
            table = np.asarray(work.block_table[:need], dtype=np.int64)
            ids[row] = work.token_ids[0]
            pos[row] = p
            ctx[row] = p + 1
            slots[row] = table[p // block] * block + p % block
            tables[row, :need] = table
        self.packed.copy_(self.host, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _get(self, bs: int) -> _Captured:
        captured = self.graphs.get(bs)
        if captured is not None:
            return captured
        batch = self._static_batch(bs)
        if not self.capture:
            captured = _Captured(None, batch, None)
        else:
            self._fill([], bs)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: lazy inits and autotuning happen outside capture
                    self._forward(batch)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self._forward(batch)
            self.pool = graph.pool()
            captured = _Captured(graph, batch, logits)
        self.graphs[bs] = captured
        return captured

    def run(self, works: Sequence[SeqWork]) -> torch.Tensor:
        """fp32 logits [len(works), vocab] of a decode-only step (KV written as usual)."""
        self._validate(works)
        n = len(works)
        bs = next(s for s in self.sizes if s >= n)
        captured = self._get(bs)
        self._fill(works, bs)
        if captured.graph is None:
            return self._forward(captured.batch)[:n]
        captured.graph.replay()
        assert captured.logits is not None
        return captured.logits[:n]
