"""TorchTierTransport: block-major host pool, copies by runs, round trips through every tier."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.model.kv_cache import KVCache
from kvpilot.model.transfer import TorchTierTransport, contiguous_runs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@given(st.lists(st.integers(0, 40), unique=True, max_size=30))
def test_contiguous_runs_cover_the_ids_in_order_and_are_maximal(ids: list[int]) -> None:
    runs = contiguous_runs(ids)
    rebuilt = [first + k for _, first, n in runs for k in range(n)]
    assert rebuilt == ids
    assert [pos for pos, _, _ in runs] == [sum(n for *_, n in runs[:i]) for i in range(len(runs))]
    for (_, first, n), (_, nxt, _) in itertools.pairwise(runs):
        assert nxt != first + n  # a run never continues into the next one


def _cache(dtype: torch.dtype) -> KVCache:
    geometry = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=8)
    cache = KVCache(geometry, 12, 4, dtype, torch.device(DEVICE))  # type: ignore[arg-type]
    cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(0)))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_round_trip_through_the_host_pool(dtype: torch.dtype) -> None:
    cache = _cache(dtype)
    transport = TorchTierTransport(cache, num_host_blocks=10)
    original = cache.data.clone()
    pairs = [(3, 4), (7, 5), (1, 6), (0, 1), (11, 9)]  # a run of three host ids, then singles
    transport.swap_out(pairs).result()
    for dev, host in pairs:
        assert torch.equal(transport.host[host].to(DEVICE), original[:, :, dev])
    cache.data[:, :, [3, 7, 1, 0, 11]] = 0
    back = [(4, 2), (5, 8), (6, 10), (1, 0), (9, 3)]
    took = transport.swap_in(back).result()
    assert took >= 0.0
    for (_, dev), (src, _) in zip(back, pairs, strict=True):
        assert torch.equal(cache.data[:, :, dev], original[:, :, src])
    for untouched in (4, 5, 6, 9):
        assert torch.equal(cache.data[:, :, untouched], original[:, :, untouched])
    transport.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_bytes_round_trip_and_keep_their_layout(dtype: torch.dtype) -> None:
    cache = _cache(dtype)
    transport = TorchTierTransport(cache, num_host_blocks=0)
    original = cache.data.clone()
    data = transport.read_device([5, 2]).result()
    assert [len(d) for d in data] == [cache.bytes_per_block] * 2
    view = torch.int16 if dtype == torch.bfloat16 else dtype
    block = original[:, :, 5].cpu().contiguous()
    assert data[0] == (block.view(view) if dtype == torch.bfloat16 else block).numpy().tobytes()
    transport.write_device([8, 9], data).result()
    assert torch.equal(cache.data[:, :, 8], original[:, :, 5])
    assert torch.equal(cache.data[:, :, 9], original[:, :, 2])
    transport.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_host_pool_is_pinned() -> None:
    transport = TorchTierTransport(_cache(torch.bfloat16), num_host_blocks=4)
    assert transport.host.is_pinned()
    transport.close()


def test_poisoned_host_blocks_are_exactly_the_named_ones() -> None:
    cache = _cache(torch.float32)
    transport = TorchTierTransport(cache, num_host_blocks=6)
    transport.swap_out([(0, 0), (1, 1), (2, 2)]).result()
    transport.poison_host([1, 4])
    assert transport.host[1].isnan().all() and transport.host[4].isnan().all()
    assert not transport.host[[0, 2, 3, 5]].isnan().any()
    transport.close()
