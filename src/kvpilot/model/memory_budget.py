"""How much device memory the KV pool gets when neither blocks nor bytes are given.

On CUDA, as in vLLM, ``gpu_memory_utilization`` is the share of the device's total memory
this engine may use for everything: weights (already loaded when the pool is sized),
activations and the KV pool. The pool gets that share less what this process already holds
and a headroom for a step's activations, and never more than is free now. On CPU the
default is a fixed pool (`DEFAULT_CPU_KV_BYTES`).
"""

from __future__ import annotations

from kvpilot.errors import ConfigError

DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
MIN_ACTIVATION_HEADROOM_BYTES = 512 << 20
ACTIVATION_HEADROOM_FRACTION = 0.02


def kv_budget_bytes(*, total: int, free: int, held_by_us: int, utilization: float) -> int:
    """KV pool bytes on a device with ``total``/``free`` bytes, this process holding some."""
    if not 0.0 < utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    headroom = max(MIN_ACTIVATION_HEADROOM_BYTES, int(total * ACTIVATION_HEADROOM_FRACTION))
    share = int(total * utilization) - held_by_us - headroom
    budget = min(share, free - headroom)
    if budget <= 0:
        raise ConfigError(
            f"no device memory left for the KV pool: {utilization:.0%} of {total / 2**30:.1f} "
            f"GiB is {total * utilization / 2**30:.1f} GiB, the model holds "
            f"{held_by_us / 2**30:.1f} GiB, {free / 2**30:.1f} GiB is free; raise "
            "--gpu-memory-utilization or give --kv-memory"
        )
    return budget


def cuda_kv_budget_bytes(device: object, utilization: float) -> int:
    import torch

    free, total = torch.cuda.mem_get_info(device)  # type: ignore[arg-type]
    held = torch.cuda.memory_reserved(device)  # type: ignore[arg-type]
    return kv_budget_bytes(total=total, free=free, held_by_us=held, utilization=utilization)
