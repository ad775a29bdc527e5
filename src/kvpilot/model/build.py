"""Assemble a real engine: checkpoint -> `ModelRunner`, tier transport, disk tier -> `Engine`.

The composition root of the PyTorch engine, as `kvpilot.sim.build` is the simulator's:
`Engine.from_pretrained` is a thin wrapper over `build_engine`.
"""

from __future__ import annotations

from pathlib import Path

from kvpilot.engine.clock import Clock
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.engine import Engine
from kvpilot.model.runner import ModelRunner

DEFAULT_KV_MEMORY_BYTES = 1 << 30


def build_engine(
    model: str | Path = "tiny",
    config: EngineConfig | None = None,
    *,
    clock: Clock | None = None,
    cache_dir: Path | None = None,
) -> Engine:
    """An engine on the checkpoint folder ``model`` (or the built-in ``tiny``)."""
    config = config or EngineConfig()
    kv_memory = config.kv_memory_bytes
    if config.kv_blocks is None and kv_memory is None:
        kv_memory = DEFAULT_KV_MEMORY_BYTES
    runner = ModelRunner(
        model,
        num_blocks=config.kv_blocks,
        kv_memory_bytes=None if config.kv_blocks is not None else kv_memory,
        block_size=config.block_size,
        dtype=config.dtype,
        device=config.device,
        attention=config.attention,
        cache_dir=cache_dir,
    )
    transport = disk = sessions = None
    if config.has_tiers:
        from kvpilot.model.transfer import TorchTierTransport

        host_blocks = config.host_kv_blocks or (
            (config.host_memory_bytes or 0) // runner.kv_bytes_per_block
        )
        transport = TorchTierTransport(runner.kv_cache, host_blocks)
    if config.disk_dir is not None and transport is not None:
        from kvpilot.store import DiskBlockStore, SessionStore

        folder = Path(config.disk_dir)
        disk = DiskBlockStore(folder, config.disk_kv_blocks, transport.block_bytes)
        sessions = SessionStore(folder)
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
