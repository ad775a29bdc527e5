"""`ShardPlan`: which slice of every checkpoint tensor one tensor-parallel rank holds.

Megatron-style sharding of a Llama-family decoder over ``degree`` ranks:

- column-parallel (rows of the ``[out, in]`` weight split): q/k/v and gate/up projections
  and their biases; each rank computes its own heads and its share of the MLP;
- row-parallel (columns split): the o and down projections; each rank's partial product is
  summed by an all-reduce, and their biases (if any) count on rank 0 only (zeros elsewhere);
- vocabulary-parallel: embedding and LM head rows split in ``ceil(vocab / degree)`` row
  shards (the last may be shorter);
- replicated: the norms (and q/k norm weights, which are per head dim).

K/V heads are split when the degree divides their count; when the degree exceeds it (and is
a multiple of it), each KV head is replicated on ``degree / kv_heads`` consecutive ranks,
whose query heads are exactly that KV head's group (what `kvpilot plan` assumes when it
sizes KV per device as ``max(kv_heads / degree, 1)`` heads).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvpilot.errors import ConfigError
from kvpilot.model.config import ModelConfig

Slice = tuple[int, int, int]  # (dim, start, stop)


def check_degree(config: ModelConfig, degree: int) -> None:
    """Refuse a degree this model cannot be split by, naming the degrees that would work."""
    if degree < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {degree}")
    heads, kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    kv_ok = kv % degree == 0 or degree % kv == 0
    if heads % degree or inter % degree or not kv_ok or config.vocab_size < degree:
        fits = [
            d
            for d in range(1, heads + 1)
            if heads % d == 0 and inter % d == 0 and (kv % d == 0 or d % kv == 0)
        ]
        raise ConfigError(
            f"tensor_parallel_size {degree} does not split this model ({heads} attention "
            f"heads, {kv} KV heads, intermediate size {inter}); the degree must divide the "
            "heads and the intermediate size, and divide or be a multiple of the KV heads: "
            f"use one of {fits}"
        )


@dataclass(frozen=True, slots=True)
class ShardPlan:
    config: ModelConfig  # the whole model's
    rank: int
    degree: int

    def __post_init__(self) -> None:
        check_degree(self.config, self.degree)
        if not 0 <= self.rank < self.degree:
            raise ConfigError(f"rank {self.rank} is outside a degree of {self.degree}")

    @property
    def heads(self) -> int:
        """Query heads on this rank."""
        return self.config.num_heads // self.degree

    @property
    def kv_heads(self) -> int:
        """KV heads on this rank (1 when replicated)."""
        return max(self.config.num_kv_heads // self.degree, 1)

    @property
    def first_kv_head(self) -> int:
        kv = self.config.num_kv_heads
        if kv >= self.degree:
            return self.rank * self.kv_heads
        return self.rank // (self.degree // kv)  # each KV head on degree / kv ranks

    @property
    def intermediate(self) -> int:
        return self.config.intermediate_size // self.degree

    @property
    def vocab_shard(self) -> int:
        """Rows of every vocabulary shard but possibly the last."""
        return -(-self.config.vocab_size // self.degree)

    @property
    def vocab_range(self) -> tuple[int, int]:
        start = min(self.rank * self.vocab_shard, self.config.vocab_size)
        return start, min(start + self.vocab_shard, self.config.vocab_size)

    def local_config(self) -> ModelConfig:
        """The geometry of this rank's shard: what its layers and KV pool are built from."""
        start, stop = self.vocab_range
        return dataclasses.replace(
            self.config,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            vocab_size=stop - start,
        )

    def slice_for(self, name: str) -> Slice | None:
        """The part of checkpoint tensor ``name`` this rank reads; None: the whole tensor."""
        d = self.config.head_dim
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            return (0, *self.vocab_range)
        if ".self_attn.q_proj." in name:
            return (0, self.rank * self.heads * d, (self.rank + 1) * self.heads * d)
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            first = self.first_kv_head * d
            return (0, first, first + self.kv_heads * d)
        if ".self_attn.o_proj.weight" in name:
            return (1, self.rank * self.heads * d, (self.rank + 1) * self.heads * d)
        if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            return (0, self.rank * self.intermediate, (self.rank + 1) * self.intermediate)
        if ".mlp.down_proj.weight" in name:
            return (1, self.rank * self.intermediate, (self.rank + 1) * self.intermediate)
        return None

    def zeroed(self, name: str) -> bool:
        """Row-parallel biases are added once, after the all-reduce: ranks other than 0 hold
        zeros in their place (so every rank runs the same code)."""
        if name.endswith("o_proj.bias") or name.endswith("down_proj.bias"):
            return self.rank != 0
        return False
