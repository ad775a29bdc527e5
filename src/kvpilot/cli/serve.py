"""``kvpilot serve``: build an engine from command-line options and serve it over HTTP."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from fastapi import FastAPI

from kvpilot.cli.options import (
    BlockSize,
    HostMemory,
    KvBlocks,
    MaxBatchedTokens,
    MaxModelLen,
    MaxNumSeqs,
    Model,
    Policy,
    PrefillChunk,
    TauHigh,
    engine_config,
    size,
)
from kvpilot.engine.config import EngineConfig
from kvpilot.errors import ConfigError, ModelLoadError
from kvpilot.server.limits import ServerLimits
from kvpilot.server.tenancy import ApiKeys


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """What ``kvpilot serve`` runs: a model, the engine's configuration, and the server's."""

    model: str = "tiny"
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    api_keys: Path | None = None
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)

    def __post_init__(self) -> None:
        disk_dir = self.engine.runner.tiers.disk_dir
        if disk_dir is not None:
            folder = Path(disk_dir)
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"--disk-dir {folder}: cannot create it ({exc})") from exc
            if not os.access(folder, os.W_OK):
                raise ConfigError(f"--disk-dir {folder} is not writable")


def build_app(options: ServeOptions) -> FastAPI:
    """The engine and app ``kvpilot serve`` would run, without starting a server."""
    from kvpilot.model.build import build_engine
    from kvpilot.server.app import create_app

    keys = ApiKeys.from_file(options.api_keys) if options.api_keys else ApiKeys()
    engine = build_engine(options.model, options.engine)
    return create_app(
        engine,
        model_name=options.model,
        limits=options.limits,
        api_keys=keys,
        options=options.engine.flat(changed_only=True),
    )


def serve(
    model: Model = "tiny",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    kv_memory: Annotated[str | None, typer.Option(help="Device KV pool size, e.g. 2GiB.")] = None,
    kv_blocks: KvBlocks = None,
    block_size: BlockSize = None,
    host_memory: HostMemory = None,
    disk_dir: Annotated[Path | None, typer.Option(help="Folder for the disk tier.")] = None,
    disk_blocks: Annotated[
        int | None, typer.Option(help="Disk tier capacity in blocks (default 4096).")
    ] = None,
    policy: Policy = "breakeven",
    pause_ttl: Annotated[
        float | None, typer.Option(help="Lease of the ttl policy, seconds (default 10).")
    ] = None,
    api_keys: Annotated[
        Path | None, typer.Option(help="API keys -> tenants file (JSON, or 'key tenant' lines).")
    ] = None,
    max_model_len: MaxModelLen = None,
    max_num_seqs: MaxNumSeqs = None,
    max_batched_tokens: MaxBatchedTokens = None,
    prefill_chunk: PrefillChunk = None,
    tau_high: TauHigh = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default cpu).")] = None,
    dtype: Annotated[
        str | None, typer.Option(help="float32, bfloat16 or float16 (default float32).")
    ] = None,
    max_tokens_limit: Annotated[
        int, typer.Option(help="Largest max_tokens a request may ask for.")
    ] = 4096,
    max_n: Annotated[int, typer.Option(help="Largest n a request may ask for.")] = 8,
    max_sessions_per_tenant: Annotated[int, typer.Option(help="Open sessions per tenant.")] = 256,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body, bytes.")] = 4 << 20,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API, with agent sessions and /metrics.

    With --host-memory and/or --disk-dir, paused sessions' KV can move to host memory or
    disk; --policy decides per pause (breakeven: the spec's break-even rule).
    """
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    try:
        config = engine_config(
            kv_memory_bytes=size(kv_memory),
            kv_blocks=kv_blocks,
            block_size=block_size,
            host_memory_bytes=size(host_memory),
            disk_dir=None if disk_dir is None else str(disk_dir),
            disk_kv_blocks=disk_blocks,
            pause_policy=policy,
            pause_ttl_s=pause_ttl,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_batched_tokens,
            max_prefill_chunk=prefill_chunk,
            tau_high=tau_high,
            device=device,
            dtype=dtype,
        )
        options = ServeOptions(
            model=model,
            engine=config,
            api_keys=api_keys,
            limits=ServerLimits(
                max_tokens_limit=max_tokens_limit,
                max_n=max_n,
                max_sessions_per_tenant=max_sessions_per_tenant,
                max_body_bytes=max_body_bytes,
            ),
        )
        app = build_app(options)
    except (ConfigError, ModelLoadError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    uvicorn.run(app, host=host, port=port, log_level="info")
