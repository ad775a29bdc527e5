"""`RankShard`: what every tensor-parallel rank holds and does (rank 0 and the workers alike).

A rank holds its shard of the weights (`ShardedLlamaModel`), its own paged KV pool with the
shard's KV heads (same block ids on every rank: the one scheduler's block tables index every
pool) and, when tiers are on, its own host pool. It runs the commands rank 0 broadcasts:
a step's forward pass, block copies and poisoning, and moves of its own shard of blocks
between its device pool, its host pool and bytes (for the disk tier).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpilot.engine.executor import SeqWork
from kvpilot.model.attention import make_attention_backend
from kvpilot.model.batch import StepBatch
from kvpilot.model.config import ModelConfig
from kvpilot.model.kv_cache import KVCache, num_blocks_for_memory
from kvpilot.model.memory_budget import DEFAULT_CPU_KV_BYTES, cuda_kv_budget_bytes
from kvpilot.model.parallel.comm import RankGroups
from kvpilot.model.parallel.plan import ShardPlan
from kvpilot.model.parallel.sharded_llama import ShardedLlamaModel
from kvpilot.model.parallel.weights import iter_shard_weights
from kvpilot.model.transfer import TorchTierTransport

# A step's works as broadcast: (token ids, start position, block table) each.
WireWork = tuple[list[int], int, list[int]]


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """How every rank builds its shard (sent to the workers when they start)."""

    path: Path
    degree: int
    device: str  # "cpu" or "cuda" (rank r uses cuda:r)
    dtype: torch.dtype
    attention: str
    block_size: int
    num_blocks: int | None
    kv_memory_bytes: int | None
    gpu_memory_utilization: float
    startup_timeout_s: float  # joining the groups and loading every shard
    threads: int  # torch threads per worker on CPU

    def device_of(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.device.startswith("cuda") else torch.device("cpu")


def to_wire(works: Sequence[SeqWork]) -> list[WireWork]:
    return [(list(w.token_ids), w.start_pos, list(w.block_table)) for w in works]


class RankShard:
    def __init__(self, spec: ShardSpec, rank: int, groups: RankGroups) -> None:
        self.spec = spec
        self.rank = rank
        self.groups = groups
        self.device = spec.device_of(rank)
        self.config = ModelConfig.from_folder(spec.path)
        self.plan = ShardPlan(self.config, rank, spec.degree)
        self.local_config = self.plan.local_config()
        self.attention = make_attention_backend(spec.attention, self.device, spec.dtype)
        weights = iter_shard_weights(spec.path, self.plan, self.device)
        self.model = ShardedLlamaModel(
            self.plan, weights, self.device, spec.dtype, groups, ops=self.attention.ops
        )
        # Every rank's pool has the same number of blocks: the fewest any rank can hold.
        self.num_blocks = groups.min_int(self._blocks_that_fit())
        self.kv_cache = KVCache(
            self.local_config, self.num_blocks, spec.block_size, spec.dtype, self.device
        )
        self.max_model_len = min(
            self.config.max_position_embeddings, self.num_blocks * spec.block_size
        )
        self.model.rope.ensure(min(self.max_model_len, 4096))
        self.transport: TorchTierTransport | None = None

    def _blocks_that_fit(self) -> int:
        spec = self.spec
        if spec.num_blocks is not None:
            return spec.num_blocks
        budget = spec.kv_memory_bytes
        if budget is None:
            budget = (
                cuda_kv_budget_bytes(self.device, spec.gpu_memory_utilization)
                if self.device.type == "cuda"
                else DEFAULT_CPU_KV_BYTES
            )
        return num_blocks_for_memory(self.local_config, budget, spec.block_size, spec.dtype)

    @property
    def shard_block_bytes(self) -> int:
        """Bytes of this rank's shard of one KV block (the same on every rank)."""
        return self.kv_cache.bytes_per_block

    def prepare(self, works: Sequence[SeqWork], wanted: Sequence[int]) -> StepBatch:
        """The step's batch (rank 0 builds it before broadcasting: a bad work fails there)."""
        return StepBatch.build(
            works,
            block_size=self.spec.block_size,
            num_blocks=self.num_blocks,
            vocab_size=self.config.vocab_size,
            max_model_len=self.max_model_len,
            device=self.device,
            wanted=wanted,
        )

    @torch.inference_mode()
    def run(self, batch: StepBatch, any_wanted: bool) -> torch.Tensor | None:
        """KV of every work; fp32 logits (whole vocabulary) of the batch's wanted works."""
        self.model.rope.ensure(batch.max_context_len)
        hidden = self.model.forward(batch, self.kv_cache, self.attention)
        if not any_wanted:
            return None
        return self.model.logits(hidden.index_select(0, batch.logits_index))

    def handle(self, op: str, payload: Any) -> Any:
        """Run one broadcast command on this rank; what it returns rank 0 may gather."""
        if op == "step":
            wire, wanted = payload
            works = [SeqWork(i, ids, start, table) for i, (ids, start, table) in enumerate(wire)]
            self.run(self.prepare(works, wanted), bool(wanted))
            return None
        with torch.inference_mode():
            if op == "copy_blocks":
                self.kv_cache.copy_blocks(payload)
            elif op == "poison_blocks":
                self.kv_cache.poison(payload)
            else:
                return self._tier(op, payload)
        return None

    def _tier(self, op: str, payload: Any) -> Any:
        if op == "open_tiers":
            self.transport = TorchTierTransport(self.kv_cache, payload)
            return None
        transport = self.transport
        if transport is None:
            raise RuntimeError(f"tier command {op!r} before open_tiers")
        if op == "swap_out":
            return transport.swap_out(payload).result()
        if op == "swap_in":
            return transport.swap_in(payload).result()
        if op == "read_device":
            return transport.read_device(payload).result()
        if op == "write_device":
            blocks, shards = payload
            return transport.write_device(blocks, shards[self.rank]).result()
        if op == "poison_host":
            transport.poison_host(payload)
            return None
        if op == "close_tiers":
            transport.close()
            self.transport = None
            return None
        raise RuntimeError(f"unknown tensor-parallel command {op!r}")
