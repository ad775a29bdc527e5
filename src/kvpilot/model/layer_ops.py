"""The element-wise ops of a decoder layer, in plain torch (the reference) or fused kernels.

Per layer: residual add + RMSNorm (twice), RoPE on q and k, SiLU(gate) * up, and the
linear layers (whose weights a backend may repack once at load time). The torch
versions follow transformers' op order (RoPE bit-identical to it); a backend may supply
fused versions (`kvpilot.model.attention.cpu.CpuKernelOps`: one pass each, RoPE in place
without concatenation) that agree with these to rounding.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from kvpilot.model.rope import RopeTable, apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; ``weight`` is [d] or broadcastable per row (q/k heads)."""
    if weight.dim() == 1:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x, (x.shape[-1],), None, eps) * weight


class LayerOps:
    """Reference implementations (any device)."""

    name = "torch"

    def add_rms_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x); ``x`` None normalises ``residual`` alone."""
        if x is not None:
            residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def rope_state(self, rope: RopeTable, positions: torch.Tensor) -> object:
        """Per-step rotation state (cos/sin rows of the step's positions)."""
        return rope.lookup(positions)

    def rope(self, qk: torch.Tensor, state: object) -> torch.Tensor:
        """q and k heads [T, heads, D] rotated (a new tensor, or ``qk`` rotated in place)."""
        cos, sin = cast(tuple[torch.Tensor, torch.Tensor], state)
        return apply_rope(qk, cos, sin)

    def prepare_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """The form of a [out, in] weight that `linear` takes (here: the weight itself)."""
        return weight

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of the fused [T, 2 * inter] projection."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
