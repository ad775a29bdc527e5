"""Random attention steps on a paged pool, run through any backend (shared by backend tests).

A case is a pool of random K/V (the cached prefixes), a few works (decodes and prefill chunks
over a cached prefix, each with its own shuffled blocks) and the step's fresh q/k/v. Running
it through a backend returns the attention output and the pool after the step's writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from hypothesis import strategies as st

from kvpilot.engine.executor import SeqWork
from kvpilot.model.attention import AttentionBackend
from kvpilot.model.batch import StepBatch
from kvpilot.model.kv_cache import KVCache


@dataclass(frozen=True)
class AttentionCase:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    window: int | None
    works: tuple[tuple[int, int], ...]  # (start_pos, num_tokens) per work
    seed: int = 0

    @property
    def blocks_per_work(self) -> int:
        longest = max(start + n for start, n in self.works)
        return -(-longest // self.block_size)


def _tables(case: AttentionCase) -> list[list[int]]:
    per = case.blocks_per_work
    order = torch.randperm(
        per * len(case.works), generator=torch.Generator().manual_seed(case.seed)
    )
    return [order[i * per : (i + 1) * per].tolist() for i in range(len(case.works))]


def run_case(
    backend: AttentionBackend,
    case: AttentionCase,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention output [T, H, D], pool after the step) of ``case`` through ``backend``."""
    generator = torch.Generator().manual_seed(case.seed)
    geometry = SimpleNamespace(num_layers=1, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim)
    tables = _tables(case)
    num_blocks = len(case.works) * case.blocks_per_work
    cache = KVCache(geometry, num_blocks, case.block_size, dtype, torch.device(device))  # type: ignore[arg-type]
    cache.data.copy_(torch.randn(cache.data.shape, generator=generator).to(dtype))
    works = [
        SeqWork(seq_id=i, token_ids=[1] * n, start_pos=start, block_table=tables[i])
        for i, (start, n) in enumerate(case.works)
    ]
    batch = StepBatch.build(
        works,
        block_size=case.block_size,
        num_blocks=num_blocks,
        vocab_size=2,
        max_model_len=1 << 20,
        device=torch.device(device),
    )
    t = batch.num_tokens
    q = torch.randn(t, case.num_heads, case.head_dim, generator=generator).to(dtype).to(device)
    k = torch.randn(t, case.num_kv_heads, case.head_dim, generator=generator).to(dtype).to(device)
    v = torch.randn(t, case.num_kv_heads, case.head_dim, generator=generator).to(dtype).to(device)
    state = backend.prepare(batch, [case.window])
    out = backend.forward(0, q, k, v, cache, batch, state, case.window)
    return out, cache.data


@st.composite
def attention_cases(draw: st.DrawFn, max_dim: int = 64) -> AttentionCase:
    num_kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    head_dim = draw(st.sampled_from([d for d in (4, 12, 16, 32, 64) if d <= max_dim]))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    window = draw(st.one_of(st.none(), st.integers(1, 24)))
    works = draw(
        st.lists(
            st.tuples(
                st.integers(0, 48),
                st.one_of(st.just(1), st.integers(1, 24)),
            ),
            min_size=1,
            max_size=5,
        )
    )
    return AttentionCase(
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        window=window,
        works=tuple(works),
        seed=draw(st.integers(0, 1000)),
    )
