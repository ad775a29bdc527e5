"""The attention backend interface: per-step preparation, then one call per layer.

A backend first `prepare`s a step (masks, index tensors, work lists: once per step, shared
by all layers), then for each layer writes the step's new K/V into their slots of the paged
pool and attends. Query token i of a work at ``start_pos`` sits at position
``start_pos + i`` and sees keys ``0 .. start_pos + i`` of its own sequence (read through its
block table); with a sliding window W it also ignores keys at positions <= p - W.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch

from kvpilot.model.batch import StepBatch
from kvpilot.model.kv_cache import KVCache
from kvpilot.model.layer_ops import LayerOps


class AttentionBackend(ABC):
    name: str
    ops: LayerOps = LayerOps()  # the element-wise layer ops that go with this backend

    @abstractmethod
    def prepare(self, batch: StepBatch, windows: Iterable[int | None]) -> object:
        """Per-step state for `forward` (built once, reused by every layer)."""

    @abstractmethod
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
        """q [T, H, D], k/v [T, H_kv, D] (already rotated) -> attention output [T, H, D].

        Writes k/v into ``cache`` at ``batch.slot_mapping`` before attending.
        """


def write_kv(
    cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the step's k/v [T, H_kv, D] in their slots; the layer's key and value pools."""
    key_cache, value_cache = cache.keys(layer), cache.values(layer)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
    return key_cache, value_cache
