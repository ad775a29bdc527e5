"""Building the tensor-parallel parts of an engine: the executor and its tier transport."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpilot.engine.config import DEFAULT_BLOCK_SIZE, RunnerConfig
from kvpilot.model.loader import LoadProgress
from kvpilot.model.parallel.executor import TensorParallelExecutor
from kvpilot.model.parallel.transport import TensorParallelTransport


def build_tensor_parallel(
    model: str | Path,
    rc: RunnerConfig,
    cache_dir: Path | None = None,
    progress: LoadProgress | None = None,
) -> tuple[TensorParallelExecutor, TensorParallelTransport | None]:
    """The executor over ``rc.tensor_parallel_size`` ranks and, with tiers, its transport.
    ``kv_memory_bytes`` sizes each rank's pool; ``host_memory_bytes`` is the node's host tier
    (each rank's host pool holds its shard of every host block)."""
    given: dict[str, Any] = {"dtype": rc.dtype, "device": rc.device, "attention": rc.attention}
    executor = TensorParallelExecutor(
        model,
        rc.tensor_parallel_size,
        num_blocks=rc.kv_blocks,
        kv_memory_bytes=rc.kv_memory_bytes,
        block_size=rc.block_size or DEFAULT_BLOCK_SIZE,
        gpu_memory_utilization=rc.gpu_memory_utilization,
        cache_dir=cache_dir,
        progress=progress,
        **{k: v for k, v in given.items() if v is not None},
    )
    tiers = rc.tiers
    if not tiers.any:
        return executor, None
    try:
        per_block = executor.kv_bytes_per_block
        host_blocks = tiers.host_kv_blocks or (tiers.host_memory_bytes or 0) // per_block
        return executor, TensorParallelTransport(executor, host_blocks)
    except BaseException:
        executor.close()
        raise
