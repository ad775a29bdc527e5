"""``kvpilot serve``: build an engine from command-line options and serve it over HTTP."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

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
from kvpilot.errors import ConfigError, KvpilotError

if TYPE_CHECKING:  # FastAPI, the server and the engine load only when `serve` runs
    from fastapi import FastAPI

    from kvpilot.engine.config import EngineConfig
    from kvpilot.server.banner import StartupBanner
    from kvpilot.server.limits import ServerLimits
    from kvpilot.server.ops import OpsConfig
    from kvpilot.server.prompt_cache import PromptCacheConfig


def _default_engine() -> EngineConfig:
    from kvpilot.engine.config import EngineConfig

    return EngineConfig()


def _default_limits() -> ServerLimits:
    from kvpilot.server.limits import ServerLimits

    return ServerLimits()


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """What ``kvpilot serve`` runs: a model, the engine's configuration (one dataclass per
    component), and the server's own options (keys, limits, the prompt cache's ledger)."""

    model: str = "tiny"
    engine: EngineConfig = dataclasses.field(default_factory=_default_engine)
    api_keys: Path | None = None
    limits: ServerLimits = dataclasses.field(default_factory=_default_limits)
    prices: Path | None = None
    usage_dir: Path | None = None
    prompt_cache_min_tokens: int = 1024
    metrics_key: str | None = None
    shutdown_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        self.ops()  # --metrics-key and --shutdown-timeout are checked with everything else
        if self.prompt_cache_min_tokens < 1:
            raise ConfigError("--prompt-cache-min-tokens must be at least 1")
        disk_dir = self.disk_dir
        if disk_dir is not None:
            try:
                disk_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"--disk-dir {disk_dir}: cannot create it ({exc})") from exc
            if not os.access(disk_dir, os.W_OK):
                raise ConfigError(f"--disk-dir {disk_dir} is not writable")

    @property
    def disk_dir(self) -> Path | None:
        folder = self.engine.runner.tiers.disk_dir
        return None if folder is None else Path(folder)

    def ops(self) -> OpsConfig:
        from kvpilot.server.ops import OpsConfig

        return OpsConfig(metrics_key=self.metrics_key, shutdown_timeout_s=self.shutdown_timeout_s)


def build_app(options: ServeOptions, banner: StartupBanner | None = None) -> FastAPI:
    """The engine and app ``kvpilot serve`` would run, without starting a server."""
    if banner is not None:
        banner.runtime()  # the longest import first, with a line before and after
    from kvpilot.model.build import build_engine
    from kvpilot.server.app import create_app
    from kvpilot.server.tenancy import ApiKeys

    keys = ApiKeys.from_file(options.api_keys) if options.api_keys else ApiKeys()
    if banner is not None:
        banner.model_source(options.model)
    engine = build_engine(options.model, options.engine, load_progress=banner)
    if banner is not None:
        banner.engine_ready(engine)
    return create_app(
        engine,
        model_name=options.model,
        limits=options.limits,
        api_keys=keys,
        options=options.engine.flat(changed_only=True),
        prompt_cache=prompt_cache_config(options),
        ops=options.ops(),
    )


def prompt_cache_config(options: ServeOptions) -> PromptCacheConfig:
    """Breakpoints' minimum length, and the usage ledger: next to the disk tier unless
    --usage-dir says where (in memory when there is neither), priced by --prices."""
    from kvpilot.promptcache.prices import PriceTable
    from kvpilot.server.prompt_cache import PromptCacheConfig

    return PromptCacheConfig(
        min_cacheable_tokens=options.prompt_cache_min_tokens,
        ledger_dir=options.usage_dir or options.disk_dir,
        prices=PriceTable.load(options.prices) if options.prices else PriceTable(),
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
    max_defer: Annotated[
        float | None,
        typer.Option(
            help="Longest a request waits (seconds) rather than evict a paused session's "
            "retained state that is back sooner than recomputing it would take (default 2; "
            "0: never)."
        ),
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default cpu).")] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16."),
    ] = None,
    attention: Annotated[
        str | None,
        typer.Option(help="Attention backend: auto (default), torch, cpu, triton."),
    ] = None,
    gpu_memory_utilization: Annotated[
        float | None,
        typer.Option(help="Share of GPU memory to use when no --kv-memory/--kv-blocks (0.9)."),
    ] = None,
    max_tokens_limit: Annotated[
        int, typer.Option(help="Largest max_tokens a request may ask for.")
    ] = 4096,
    max_n: Annotated[int, typer.Option(help="Largest n a request may ask for.")] = 8,
    max_sessions_per_tenant: Annotated[
        int, typer.Option(help="Open sessions per tenant (per client address without keys).")
    ] = 256,
    session_ttl: Annotated[
        float, typer.Option(help="Seconds an idle session lives before it expires.")
    ] = 3600.0,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body, bytes.")] = 4 << 20,
    poison_freed_blocks: Annotated[
        bool,
        typer.Option(
            help="Overwrite every freed KV block with NaN, so a stale read shows (a check)."
        ),
    ] = False,
    tp: Annotated[
        int,
        typer.Option(
            "--tp", help="Tensor-parallel degree: shard the model over N ranks (processes)."
        ),
    ] = 1,
    replicas: Annotated[
        int, typer.Option(help="Engine replicas on Ray Serve behind kvpilot's prefix router.")
    ] = 1,
    ray_address: Annotated[
        str | None, typer.Option(help="Join this Ray cluster (default: start a local one).")
    ] = None,
    router: Annotated[
        str, typer.Option(help="Fleet router: kvpilot, round_robin, power_of_two, ...")
    ] = "kvpilot",
    prices: Annotated[
        Path | None, typer.Option(help="Price table for the usage ledger (TOML, per Mtok).")
    ] = None,
    usage_dir: Annotated[
        Path | None, typer.Option(help="Folder of the usage ledger (default: --disk-dir).")
    ] = None,
    prompt_cache_min_tokens: Annotated[
        int, typer.Option(help="Shortest prefix a cache_control breakpoint caches, tokens.")
    ] = 1024,
    metrics_key: Annotated[
        str | None,
        typer.Option(help="Admin key for /metrics (with --api-keys; else loopback only)."),
    ] = None,
    shutdown_timeout: Annotated[
        float,
        typer.Option(help="Seconds in-flight requests get on SIGTERM/SIGINT before abort."),
    ] = 30.0,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API, with agent sessions and /metrics.

    With --host-memory and/or --disk-dir, paused sessions' KV can move to host memory or
    disk; --policy decides per pause (breakeven: the spec's break-even rule). Anthropic's
    /v1/messages is served too, with cache breakpoints; usage goes to a ledger
    (GET /v1/usage), priced by --prices. With --replicas N (or --ray-address), N engine
    replicas run on Ray Serve behind kvpilot's prefix-aware router (needs the fleet
    extra: pip install 'kvpilot[fleet]').
    """
    from kvpilot.cli.checks import DTYPE_NAMES, check_checkpoint, check_choice, check_device

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    try:  # everything is checked before anything is loaded
        check_checkpoint(model)
        check_device(device)
        if dtype is not None:
            check_choice(dtype, DTYPE_NAMES, "--dtype")
        config = engine_config(
            kv_memory_bytes=size(kv_memory, "--kv-memory"),
            kv_blocks=kv_blocks,
            block_size=block_size,
            host_memory_bytes=size(host_memory, "--host-memory"),
            disk_dir=None if disk_dir is None else str(disk_dir),
            disk_kv_blocks=disk_blocks,
            pause_policy=policy,
            pause_ttl_s=pause_ttl,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_batched_tokens,
            max_prefill_chunk=prefill_chunk,
            tau_high=tau_high,
            max_defer_s=max_defer,
            device=device,
            dtype=dtype,
            attention=attention,
            gpu_memory_utilization=gpu_memory_utilization,
            poison_freed_blocks=True if poison_freed_blocks else None,
            tensor_parallel_size=tp if tp != 1 else None,
        )
        options = ServeOptions(
            model=model,
            engine=config,
            api_keys=api_keys,
            limits=_limits(
                max_tokens_limit, max_n, max_sessions_per_tenant, max_body_bytes, session_ttl
            ),
            prices=prices,
            usage_dir=usage_dir,
            prompt_cache_min_tokens=prompt_cache_min_tokens,
            metrics_key=metrics_key,
            shutdown_timeout_s=shutdown_timeout,
        )
    except KvpilotError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    if replicas > 1 or ray_address is not None:
        _serve_fleet(options, replicas, router, ray_address, host, port)
        return
    from kvpilot.server.banner import StartupBanner

    banner = StartupBanner()
    banner.starting(model, device, dtype)
    try:
        app = build_app(options, banner)
    except KvpilotError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    import uvicorn

    from kvpilot.server.ops import GracefulServer, drain_hook

    banner.listening(f"http://{host}:{port}")
    server_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        timeout_graceful_shutdown=math.ceil(options.shutdown_timeout_s),
    )
    GracefulServer(server_config, on_drain=drain_hook(app)).run()


def _limits(
    max_tokens: int, max_n: int, sessions: int, body_bytes: int, session_ttl_s: float
) -> ServerLimits:
    from kvpilot.server.limits import ServerLimits

    return ServerLimits(
        max_tokens_limit=max_tokens,
        max_n=max_n,
        max_sessions_per_tenant=sessions,
        max_body_bytes=body_bytes,
        session_ttl_s=session_ttl_s,
    )


def _serve_fleet(
    options: ServeOptions,
    replicas: int,
    router: str,
    ray_address: str | None,
    host: str,
    port: int,
) -> None:
    from kvpilot.fleet.serve.deploy import FleetOptions, deploy

    try:
        fleet = FleetOptions(
            replicas=replicas, router=router, ray_address=ray_address, host=host, port=port
        )
        deploy(options, fleet)
    except KvpilotError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
