"""Token sampling: greedy, temperature, top-k, top-p, reproducible per (seed, step).

Random draws use the Gumbel-max trick with counter-based noise: the noise of token v for a
row is a hash of (seed, step, v), computed with exact integer arithmetic. The token sampled
at generation step ``step`` therefore depends only on ``(seed, step)`` and the logits: not
on the batch it ran in, the device, or what was sampled before. ``argmax(logits / T + G)``
with i.i.d. Gumbel noise G is an exact sample of ``softmax(logits / T)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.engine.sampling import SamplingParams
from kvpilot.model.batch import upload

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SampleRow:
    """One draw: the parameters, and the (seed, step) that fix its noise."""

    params: SamplingParams
    seed: int
    step: int


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_key(seed: int, step: int) -> int:
    """A 32-bit key mixing seed and step (seed may be any Python int)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64)) & _MASK32


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for uint32 values held in int64, without int64 overflow."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """The 'lowbias32' integer hash (Wellons) on uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """fp32 [n, vocab] standard Gumbel noise, a pure function of (row key, token id)."""
    token_ids = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    bits = _hash32(_hash32(token_ids)[None, :] ^ keys[:, None])
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(uniform))


class Sampler:
    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
        """One token per row of fp32 ``logits`` [n, vocab]."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sample rows")
        if not rows:
            return []
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()
        device = logits.device
        vocab = logits.shape[1]
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        picked = [rows[i] for i in random_rows]
        # Every per-row input in one host -> device transfer (floats as their int64 bits).
        g_index, r_index, keys, top_k, temperature, top_p = upload(
            [
                np.asarray(greedy_rows, dtype=np.int64),
                np.asarray(random_rows, dtype=np.int64),
                np.asarray([row_key(r.seed, r.step) for r in picked], dtype=np.int64),
                np.asarray(
                    [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in picked],
                    dtype=np.int64,
                ),
                np.asarray([r.params.temperature for r in picked], dtype=np.float64).view(np.int64),
                np.asarray([r.params.top_p for r in picked], dtype=np.float64).view(np.int64),
            ],
            device,
        )
        tokens = torch.empty(len(rows), dtype=torch.int64, device=device)
        if greedy_rows:
            tokens[g_index] = logits[g_index].argmax(dim=-1)
        filtered = any(0 < r.params.top_k < vocab or r.params.top_p < 1.0 for r in picked)
        tokens[r_index] = self._sample_random(
            logits[r_index],
            keys,
            temperature.view(torch.float64).float(),
            top_k if filtered else None,
            top_p.view(torch.float64).float(),
        )
        return tokens.tolist()

    @staticmethod
    def _sample_random(
        logits: torch.Tensor,
        keys: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor | None,
        top_p: torch.Tensor,
    ) -> torch.Tensor:
        """``top_k`` None: no row filters (neither top-k nor top-p)."""
        device = logits.device
        vocab = logits.shape[1]
        scaled = logits / temperature[:, None]
        noise = gumbel_noise(keys, vocab)
        if top_k is None:
            return (scaled + noise).argmax(dim=-1)
        # Filter in sorted order; stable sort keeps the lowest token id first among ties.
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        keep = ranks < top_k[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= mass_before < top_p[:, None]
        keep[:, 0] = True
        scores = (sorted_logits + noise.gather(1, order)).masked_fill(~keep, float("-inf"))
        return order.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
