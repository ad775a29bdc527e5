"""The paged KV pool on the device: one preallocated tensor for every layer's K and V.

Layout ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``: a block is the
same slice of every layer, so copying or moving a block is one indexing op. Token position p
of a sequence lives in slot ``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpilot.errors import ConfigError, InvalidRequest
from kvpilot.model.config import ModelConfig


def kv_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, num_layers: int | None = None
) -> int:
    """M_block = 2 · L · H_kv · B · d_head · b_elem (L: ``num_layers``, default all)."""
    elem = torch.empty((), dtype=dtype).element_size()
    layers = config.num_layers if num_layers is None else num_layers
    return 2 * layers * config.num_kv_heads * block_size * config.head_dim * elem


def num_blocks_for_memory(
    config: ModelConfig, memory_bytes: int, block_size: int, dtype: torch.dtype
) -> int:
    per_block = kv_bytes_per_block(config, block_size, dtype)
    blocks = memory_bytes // per_block
    if blocks < 1:
        raise ConfigError(
            f"KV memory of {memory_bytes} bytes holds no block of {per_block} bytes "
            f"(block_size {block_size}); give more memory or a smaller block size"
        )
    return int(blocks)


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_layers: int | None = None,
    ) -> None:
        """``num_layers``: the layers of one layer group (hybrid models), default all."""
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(
                f"the KV pool needs num_blocks >= 1 and block_size >= 1, "
                f"got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        layers = config.num_layers if num_layers is None else num_layers
        self.bytes_per_block = kv_bytes_per_block(config, block_size, dtype, layers)
        self.data = torch.zeros(
            layers,
            2,
            num_blocks,
            block_size,
            config.num_kv_heads,
            config.head_dim,
            dtype=dtype,
            device=device,
        )

    def keys(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, H_kv, d_head] view of one layer's keys."""
        return self.data[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    def _block_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise InvalidRequest(f"block ids {bad} are outside the pool of {self.num_blocks}")
        return torch.tensor(ids, dtype=torch.long, device=self.data.device)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer. Destinations must be distinct."""
        if not pairs:
            return
        dst_ids = [dst for _, dst in pairs]
        if len(set(dst_ids)) != len(dst_ids):
            raise InvalidRequest(f"copy_blocks got a destination block twice: {dst_ids}")
        src = self._block_index([src for src, _ in pairs])
        dst = self._block_index(dst_ids)
        self.data[:, :, dst] = self.data[:, :, src]

    def poison(self, block_ids: Sequence[int]) -> None:
        """Overwrite whole blocks with NaN (a test aid: a stale read of a freed block shows)."""
        if block_ids:
            poison_blocks(self.data, self._block_index(block_ids))


POISON_INT_PATTERN = 0x5A  # each byte of an integer-typed poisoned block (there is no NaN)


def poison_blocks(data: torch.Tensor, index: torch.Tensor) -> None:
    """Blocks ``index`` (dim 2) of a KV pool tensor become NaN, or a fixed garbage pattern for
    integer dtypes."""
    if data.dtype.is_floating_point:
        data.index_fill_(2, index, float("nan"))
        return
    pattern = int.from_bytes(
        bytes([POISON_INT_PATTERN]) * data.element_size(), "little", signed=True
    )
    data.index_fill_(2, index, pattern)
