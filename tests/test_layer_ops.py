"""Fused CPU layer ops (add + RMSNorm, RoPE in place, SiLU * mul) against the torch reference."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvpilot.model.attention.cpu import CpuKernelOps
from kvpilot.model.kernels.build import load_cpu_kernel
from kvpilot.model.layer_ops import LayerOps
from kvpilot.model.rope import RopeTable


@pytest.fixture(scope="module")
def fused(tmp_path_factory: pytest.TempPathFactory) -> CpuKernelOps:
    loaded = load_cpu_kernel(tmp_path_factory.mktemp("kernels"))
    assert loaded.library is not None, loaded.reason
    return CpuKernelOps(loaded.library)


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fused_add_rms_norm_matches_add_then_norm(
    fused: CpuKernelOps, dtype: torch.dtype, rows: int
) -> None:
    g = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 96, generator=g).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    want_out, want_res = LayerOps().add_rms_norm(x, residual.clone(), weight, 1e-6)
    got_out, got_res = fused.add_rms_norm(x, residual.clone(), weight, 1e-6)
    assert torch.equal(got_res, want_res)  # the add rounds exactly like torch's
    torch.testing.assert_close(got_out, want_out, **_tolerance(dtype))
    alone_want, _ = LayerOps().add_rms_norm(None, residual, weight, 1e-6)
    alone_got, same = fused.add_rms_norm(None, residual, weight, 1e-6)
    assert same is residual
    torch.testing.assert_close(alone_got, alone_want, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_matches_the_reference_rotation(
    fused: CpuKernelOps, dtype: torch.dtype
) -> None:
    config = SimpleNamespace(head_dim=32, rope_theta=10000.0, rope_scaling=None)
    table = RopeTable(config, torch.device("cpu"), dtype, 4096)  # type: ignore[arg-type]
    table.ensure(2000)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(9, 7 * 32 + 2 * 32, generator=g).to(dtype)  # q and k heads, then v
    qk = qkv[:, : 7 * 32].view(9, 7, 32)  # a strided view, as in the model
    positions = torch.tensor([0, 1, 5, 17, 63, 64, 511, 1000, 1999])
    want = LayerOps().rope(qk, LayerOps().rope_state(table, positions))
    v_before = qkv[:, 7 * 32 :].clone()
    got = fused.rope(qk, fused.rope_state(table, positions))
    assert got.data_ptr() == qk.data_ptr()  # rotated in place
    torch.testing.assert_close(got, want, **_tolerance(dtype))
    assert torch.equal(qkv[:, 7 * 32 :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_mul_matches_silu_then_mul(fused: CpuKernelOps, dtype: torch.dtype) -> None:
    gate_up = torch.randn(33, 2 * 80, generator=torch.Generator().manual_seed(1)).to(dtype) * 4
    torch.testing.assert_close(
        fused.silu_mul(gate_up), LayerOps().silu_mul(gate_up), **_tolerance(dtype)
    )


def test_unsupported_dtypes_fall_back_to_torch(fused: CpuKernelOps, tmp_path: Path) -> None:
    x = torch.randn(4, 16, dtype=torch.float16)
    out, _ = fused.add_rms_norm(None, x, torch.ones(16, dtype=torch.float16), 1e-6)
    want, _ = LayerOps().add_rms_norm(None, x, torch.ones(16, dtype=torch.float16), 1e-6)
    assert torch.equal(out, want)
