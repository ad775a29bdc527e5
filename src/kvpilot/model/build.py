"""Assemble a real engine: checkpoint -> executor (`ModelRunner`, or `TensorParallelExecutor`
over `tensor_parallel_size` ranks), tier transport, disk tier -> `Engine`.

The composition root of the PyTorch engine, as `kvpilot.sim.build` is the simulator's:
`Engine.from_pretrained` is a thin wrapper over `build_engine`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvpilot.engine.clock import Clock
from kvpilot.engine.config import DEFAULT_BLOCK_SIZE, EngineConfig
from kvpilot.engine.engine import Engine
from kvpilot.engine.executor import Executor, TierTransport
from kvpilot.model.runner import ModelRunner
from kvpilot.model.transfer import TorchTierTransport

if TYPE_CHECKING:
    from kvpilot.model.loader import LoadProgress


def build_engine(
    model: str | Path = "tiny",
    config: EngineConfig | None = None,
    *,
    clock: Clock | None = None,
    cache_dir: Path | None = None,
    load_progress: LoadProgress | None = None,
) -> Engine:
    """An engine on the checkpoint folder ``model`` (or the built-in ``tiny``).

    Every `RunnerConfig` field is honoured: the pool is ``kv_blocks`` blocks, or as many as
    ``kv_memory_bytes`` holds (neither: sized from ``gpu_memory_utilization`` on CUDA, see
    `kvpilot.model.memory_budget`); the host tier is ``host_kv_blocks`` blocks, or
    as many as ``host_memory_bytes`` holds; the disk tier lives in ``disk_dir``.
    """
    config = config or EngineConfig()
    rc = config.runner
    runner: Executor
    transport: TierTransport | None
    if rc.tensor_parallel_size > 1:
        from kvpilot.model.parallel.build import build_tensor_parallel

        runner, transport = build_tensor_parallel(model, rc, cache_dir, load_progress)
    else:
        runner, transport = _single_device(model, config, cache_dir, load_progress)
    tiers = rc.tiers
    disk = sessions = None
    try:
        if tiers.disk_dir is not None and transport is not None:
            from kvpilot.store import DiskBlockStore, SessionStore

            folder = Path(tiers.disk_dir)
            model_id = runner.fingerprint
            sharded = getattr(transport, "open_disk_store", None)  # a store per TP rank
            disk = (
                sharded(folder, tiers.disk_slots, model_id)
                if sharded is not None
                else DiskBlockStore(folder, tiers.disk_slots, transport.block_bytes, model=model_id)
            )
            sessions = SessionStore(folder, model=model_id)
        return Engine(
            runner,
            config,
            tokenizer=runner.tokenizer,
            eos_token_ids=runner.eos_token_ids,
            max_model_len=runner.max_model_len,
            vocab_size=runner.config.vocab_size,
            clock=clock,
            transport=transport,
            disk=disk,
            session_store=sessions,
        )
    except BaseException:
        for opened in (disk, sessions, transport, runner):
            close = getattr(opened, "close", None)
            if close is not None:
                close()
        raise


def _single_device(
    model: str | Path,
    config: EngineConfig,
    cache_dir: Path | None,
    load_progress: LoadProgress | None,
) -> tuple[ModelRunner, TorchTierTransport | None]:
    rc = config.runner
    given = {"dtype": rc.dtype, "device": rc.device, "attention": rc.attention}
    runner = ModelRunner(
        model,
        num_blocks=rc.kv_blocks,
        kv_memory_bytes=rc.kv_memory_bytes,
        block_size=rc.block_size or DEFAULT_BLOCK_SIZE,
        gpu_memory_utilization=rc.gpu_memory_utilization,
        cuda_graphs=rc.cuda_graphs,
        release_window_blocks=rc.release_window_blocks,
        num_window_blocks=rc.window_kv_blocks,
        tiered=rc.tiers.any,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        cache_dir=cache_dir,
        progress=load_progress,
        **{k: v for k, v in given.items() if v is not None},
    )
    tiers = rc.tiers
    if not tiers.any:
        return runner, None
    host_blocks = tiers.host_kv_blocks or (
        (tiers.host_memory_bytes or 0) // runner.kv_bytes_per_block
    )
    return runner, TorchTierTransport(runner.kv_cache, host_blocks)
