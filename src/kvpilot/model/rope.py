"""Rotary position embeddings: inverse frequencies (default, linear, llama3) and cos/sin tables.

The formulas and the order of floating-point operations follow transformers' Llama code, so
our cos/sin tables are bit-identical to the ones it computes per forward pass.
"""

from __future__ import annotations

import math

import torch

from kvpilot.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """fp32 [head_dim // 2] inverse frequencies, after the config's rope scaling."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RopeTable:
    """cos/sin of every position up to ``max_positions``, [P, head_dim] each, in the model dtype.

    ``sin`` is stored with its first half negated, so rotation needs no negation op:
    ``x * cos + cat(x2, x1) * sin`` equals transformers' ``x * cos + cat(-x2, x1) * sin``
    bit for bit.

    Built lazily and grown by doubling, so a 128k-context model does not pay for positions it
    never sees.
    """

    def __init__(
        self, config: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int
    ) -> None:
        self.inv_freq = inverse_frequencies(config).to(device)
        self.max_positions = max_positions
        self.device = device
        self.dtype = dtype
        self.cos = torch.empty(0, config.head_dim, device=device, dtype=dtype)
        self.sin = torch.empty(0, config.head_dim, device=device, dtype=dtype)

    def ensure(self, num_positions: int) -> None:
        if num_positions <= self.cos.shape[0]:
            return
        size = min(self.max_positions, max(num_positions, 2 * self.cos.shape[0], 256))
        positions = torch.arange(size, device=self.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(self.dtype)
        sin = freqs.sin().to(self.dtype)
        self.sin = torch.cat((-sin, sin), dim=-1)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] for broadcasting over heads."""
        return (
            self.cos.index_select(0, positions).unsqueeze(1),
            self.sin.index_select(0, positions).unsqueeze(1),
        )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated with the half-split convention of HF Llama.

    ``signed_sin`` comes from `RopeTable` (first half negated).
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (swapped * signed_sin)
