"""Attention backends over the paged KV pool, chosen by name or by default per device.

- ``torch``: the pure-torch reference (gathers contexts, SDPA); CPU and CUDA.
- ``cpu``: a C++/OpenMP kernel reading K/V in place through block tables (built on first
  use with the system compiler).
- ``triton``: Triton kernels for paged decode and chunked prefill over a cached prefix
  (CUDA; on CPU only under Triton's interpreter, for tests).
- ``auto`` (the default): ``triton`` on CUDA, ``cpu`` on CPU, each falling back to
  ``torch`` with a log line when it cannot run there (no Triton, no compiler, a dtype the
  kernel does not take).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from kvpilot.errors import ConfigError
from kvpilot.model.attention.base import AttentionBackend
from kvpilot.model.attention.reference import TorchAttention

__all__ = ["BACKEND_NAMES", "AttentionBackend", "TorchAttention", "make_attention_backend"]

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")
log = logging.getLogger(__name__)


def _cpu(dtype: torch.dtype, kernel_cache: Path | None) -> AttentionBackend:
    from kvpilot.model.attention.cpu import KERNEL_DTYPES, CpuPagedAttention
    from kvpilot.model.kernels.build import load_cpu_kernel

    if dtype not in KERNEL_DTYPES:
        raise ConfigError(f"attention 'cpu' takes float32 or bfloat16, not {dtype}")
    loaded = load_cpu_kernel(kernel_cache)
    if loaded.library is None:
        raise ConfigError(f"attention 'cpu' is unavailable: {loaded.reason}")
    return CpuPagedAttention(loaded.library)


def _triton(device: torch.device) -> AttentionBackend:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        raise ConfigError("attention 'triton' runs on CUDA devices; use 'cpu' or 'torch' here")
    try:
        from kvpilot.model.attention.triton import TritonAttention
    except ImportError as exc:
        raise ConfigError(f"attention 'triton' is unavailable: {exc}") from exc
    return TritonAttention()


def make_attention_backend(
    name: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    kernel_cache: Path | None = None,
) -> AttentionBackend:
    """The backend called ``name`` for this device and dtype (``auto``: the fastest that runs).

    An explicit name that cannot run here raises `ConfigError` saying why; ``auto`` falls
    back to the reference backend and logs the reason.
    """
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ConfigError(
            f"unknown attention backend {name!r}; available: {', '.join(BACKEND_NAMES)}"
        )
    if name == "torch":
        return TorchAttention()
    if name == "cpu":
        if device.type != "cpu":
            raise ConfigError(f"attention 'cpu' runs on the CPU, not on {device.type}")
        return _cpu(dtype, kernel_cache)
    if name == "triton":
        return _triton(device)
    preferred = "triton" if device.type == "cuda" else "cpu"
    try:
        return _triton(device) if preferred == "triton" else _cpu(dtype, kernel_cache)
    except ConfigError as exc:
        log.warning("attention: using the reference 'torch' backend (%s)", exc)
        return TorchAttention()
