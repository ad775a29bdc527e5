"""`ShardedLlamaModel`: one rank's shard of a Llama-family decoder.

The layers are the plain `LlamaModel`'s, built from this rank's slices (`ShardPlan`) with
the shard's geometry (its heads, KV heads, intermediate size and vocabulary rows); three
hooks add the collectives: the vocabulary-parallel embedding (each rank looks up the ids
in its rows, zeros elsewhere, then an all-reduce), the all-reduce after each row-parallel
projection (o and down), and the all-gather of the vocabulary-parallel LM head's logits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from kvpilot.model.layer_ops import LayerOps
from kvpilot.model.llama import LlamaModel
from kvpilot.model.parallel.comm import RankGroups
from kvpilot.model.parallel.plan import ShardPlan


class ShardedLlamaModel(LlamaModel):
    def __init__(
        self,
        plan: ShardPlan,
        weights: Iterable[tuple[str, torch.Tensor]],
        device: torch.device,
        dtype: torch.dtype,
        groups: RankGroups,
        ops: LayerOps | None = None,
    ) -> None:
        super().__init__(plan.local_config(), weights, device, dtype, ops)
        self.plan = plan
        self.groups = groups
        self.vocab_start, self.vocab_stop = plan.vocab_range
        self.vocab_size = plan.config.vocab_size

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.vocab_stop - self.vocab_start
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= rows)
        embedded = F.embedding(local.clamp(0, max(rows - 1, 0)), self.embed)
        embedded.masked_fill_(outside.unsqueeze(1), 0.0)
        return self.groups.all_reduce(embedded)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.groups.all_reduce(partial)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        shard = self.plan.vocab_shard
        if logits.shape[1] < shard:  # the last shard may be short: pad to equal shapes
            logits = F.pad(logits, (0, shard - logits.shape[1]))
        parts = self.groups.all_gather(logits.contiguous())
        return torch.cat(parts, dim=1)[:, : self.vocab_size]
