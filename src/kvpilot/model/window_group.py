"""The model side of sliding-window block release: one KV pool per layer group.

A model with sliding-window layers (``ModelConfig.sliding_layers``) keeps the full-attention
layers' KV in the main `KVCache` (indexed by the engine's block tables, as for any model)
and the sliding-window layers' KV in a second `KVCache` indexed by the window tables
(`SeqWork.window_table`, `kvpilot.memory.window`). Block 0 of the window pool is the null
block: all zeros, never written, never freed; the window tables point released blocks at it,
so a kernel that reads a whole context reads zeros there, and masks them (they are outside
the window).

Each step builds a second `StepBatch` from the window tables (same tokens, same positions,
the window group's slots), and each layer attends over its own group's pool and batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpilot.engine.executor import SeqWork, WindowGroupSpec
from kvpilot.errors import ConfigError, InvalidRequest
from kvpilot.model.batch import StepBatch
from kvpilot.model.config import ModelConfig
from kvpilot.model.kv_cache import KVCache, kv_bytes_per_block
from kvpilot.sizing.pool_split import PoolSplit, split_pool


def has_window_group(config: ModelConfig, *, tiered: bool = False) -> bool:
    """Whether the model's sliding-window layers get a pool of their own. Not with host or
    disk tiers (``tiered``) when every layer is windowed: window KV stays on the device, so
    the tiers would hold nothing (such a model keeps every block in the one pool)."""
    if config.sliding_window is None or not any(config.sliding_layers):
        return False
    return not (tiered and all(config.sliding_layers))


@dataclass(frozen=True, slots=True)
class LayerGroups:
    """Which pool each layer's KV lives in: ``local[i]`` is layer i's index in its group."""

    windowed: tuple[bool, ...]
    local: tuple[int, ...]

    @classmethod
    def of(cls, config: ModelConfig) -> LayerGroups:
        windowed = tuple(config.layer_window(i) is not None for i in range(config.num_layers))
        counts = [0, 0]
        local = []
        for w in windowed:
            local.append(counts[w])
            counts[w] += 1
        return cls(windowed, tuple(local))

    @property
    def num_full(self) -> int:
        return self.windowed.count(False)

    @property
    def num_windowed(self) -> int:
        return self.windowed.count(True)


def split_kv_budget(
    config: ModelConfig,
    memory_bytes: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> PoolSplit:
    """The two pools' blocks, as `kvpilot.sizing.pool_split.split_pool` splits them (the
    simulator sizes its pools the same way): the window pool holds every running sequence's
    window (ceil(W/B) + 1 blocks) plus its growing block, plus one step's new tokens, for
    at most as many sequences as the budget holds at the model's longest context; the main
    (full-attention) pool gets the rest."""
    assert config.sliding_window is not None
    layers = LayerGroups.of(config)
    return split_pool(
        memory_bytes,
        kv_bytes_per_block(config, block_size, dtype, layers.num_full),
        kv_bytes_per_block(config, block_size, dtype, layers.num_windowed),
        window_tokens=config.sliding_window,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        longest_tokens=config.max_position_embeddings,
    )


class WindowGroup:
    """The window group's KV pool and its per-step batch."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks < 2:
            raise ConfigError(
                f"the sliding-window pool needs >= 2 blocks (block 0 is the null block), got "
                f"{num_blocks}"
            )
        assert config.sliding_window is not None
        self.layers = LayerGroups.of(config)
        block_bytes = kv_bytes_per_block(config, block_size, dtype, self.layers.num_windowed)
        self.spec = WindowGroupSpec(config.sliding_window, num_blocks, block_bytes)
        self.cache = KVCache(
            config, num_blocks, block_size, dtype, device, num_layers=self.layers.num_windowed
        )

    def batch(self, works: Sequence[SeqWork], full: StepBatch, **build: object) -> StepBatch:
        """The step's batch over the window tables (``build``: `StepBatch.build`'s options)."""
        windowed = []
        for work in works:
            if work.window_table is None:
                raise InvalidRequest(
                    f"seq {work.seq_id}: a hybrid model's work needs a window table"
                )
            windowed.append(work._replace(block_table=work.window_table))
        return StepBatch.build(
            windowed,
            block_size=full.block_size,
            num_blocks=self.spec.num_blocks,
            **build,  # type: ignore[arg-type]
        )

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.cache.copy_blocks(pairs)

    def poison(self, blocks: Sequence[int]) -> None:
        if 0 in blocks:
            raise InvalidRequest("the null window block is never freed, so never poisoned")
        self.cache.poison(blocks)
