"""``kvpilot serve``: build an engine from command-line options and serve it over HTTP."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvpilot.errors import ConfigError, KvpilotError
from kvpilot.policy.pause import POLICY_NAMES

if TYPE_CHECKING:  # FastAPI and the server load only when `serve` runs
    from fastapi import FastAPI

    from kvpilot.server.banner import StartupBanner
    from kvpilot.server.limits import ServerLimits
    from kvpilot.server.prompt_cache import PromptCacheConfig


def _default_limits() -> ServerLimits:
    from kvpilot.server.limits import ServerLimits

    return ServerLimits()


@dataclass(frozen=True, slots=True)
class ServeOptions:
    model: str = "tiny"
    kv_memory_bytes: int | None = None
    kv_blocks: int | None = None
    host_memory_bytes: int | None = None
    disk_dir: Path | None = None
    policy: str = "breakeven"
    disk_blocks: int | None = None
    pause_ttl_s: float | None = None
    api_keys: Path | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    device: str | None = None
    dtype: str | None = None
    poison_freed_blocks: bool = False
    attention: str | None = None
    gpu_memory_utilization: float | None = None
    limits: ServerLimits = dataclasses.field(default_factory=_default_limits)
    prices: Path | None = None
    usage_dir: Path | None = None
    prompt_cache_min_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.prompt_cache_min_tokens < 1:
            raise ConfigError("--prompt-cache-min-tokens must be at least 1")
        if self.kv_memory_bytes is not None and self.kv_blocks is not None:
            raise ConfigError("give --kv-memory or --kv-blocks, not both")
        if self.policy not in POLICY_NAMES:
            raise ConfigError(f"--policy {self.policy!r} is unknown; known: {list(POLICY_NAMES)}")
        if self.host_memory_bytes is not None and self.host_memory_bytes <= 0:
            raise ConfigError("--host-memory must be positive")
        if self.disk_blocks is not None and self.disk_blocks < 1:
            raise ConfigError("--disk-blocks must be positive")
        if self.disk_blocks is not None and self.disk_dir is None:
            raise ConfigError("--disk-blocks sizes the disk tier: give --disk-dir too")
        if self.pause_ttl_s is not None and self.pause_ttl_s < 0:
            raise ConfigError("--pause-ttl must not be negative")
        if self.disk_dir is not None:
            try:
                self.disk_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"--disk-dir {self.disk_dir}: cannot create it ({exc})") from exc
            if not os.access(self.disk_dir, os.W_OK):
                raise ConfigError(f"--disk-dir {self.disk_dir} is not writable")


def engine_options(options: ServeOptions) -> dict[str, Any]:
    """The `Engine.from_pretrained` options (EngineConfig fields) these serve options mean."""
    given = {
        "kv_blocks": options.kv_blocks,
        "kv_memory_bytes": options.kv_memory_bytes,
        "max_model_len": options.max_model_len,
        "max_num_seqs": options.max_num_seqs,
        "device": options.device,
        "dtype": options.dtype,
        "attention": options.attention,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "host_memory_bytes": options.host_memory_bytes,
        "disk_dir": str(options.disk_dir) if options.disk_dir is not None else None,
        "disk_kv_blocks": options.disk_blocks,
        "pause_ttl_s": options.pause_ttl_s,
        "pause_policy": options.policy,
        "poison_freed_blocks": True if options.poison_freed_blocks else None,
    }
    return {k: v for k, v in given.items() if v is not None}


def build_app(options: ServeOptions, banner: StartupBanner | None = None) -> FastAPI:
    """The engine and app ``kvpilot serve`` would run, without starting a server."""
    if banner is not None:
        banner.runtime()  # the longest import first, with a line before and after
    from kvpilot.engine import Engine
    from kvpilot.server.app import create_app
    from kvpilot.server.tenancy import ApiKeys

    keys = ApiKeys.from_file(options.api_keys) if options.api_keys else ApiKeys()
    given = engine_options(options)
    if banner is not None:
        banner.model_source(options.model)
    engine = Engine.from_pretrained(options.model, load_progress=banner, **given)
    if banner is not None:
        banner.engine_ready(engine)
    return create_app(
        engine,
        model_name=options.model,
        limits=options.limits,
        api_keys=keys,
        options=given,
        prompt_cache=prompt_cache_config(options),
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


def _size(text: str | None) -> int | None:
    if text is None:
        return None
    from kvpilot.units import parse_bytes

    return int(parse_bytes(text))


def serve(
    model: Annotated[str, typer.Option(help="Checkpoint folder, or 'tiny' (built in).")] = "tiny",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    kv_memory: Annotated[str | None, typer.Option(help="Device KV pool size, e.g. 2GiB.")] = None,
    kv_blocks: Annotated[int | None, typer.Option(help="Device KV pool in blocks.")] = None,
    host_memory: Annotated[str | None, typer.Option(help="Host tier size, e.g. 32GiB.")] = None,
    disk_dir: Annotated[Path | None, typer.Option(help="Folder for the disk tier.")] = None,
    disk_blocks: Annotated[
        int | None, typer.Option(help="Disk tier capacity in blocks (default 4096).")
    ] = None,
    policy: Annotated[
        str, typer.Option(help=f"Pause policy: {', '.join(POLICY_NAMES)}.")
    ] = "breakeven",
    pause_ttl: Annotated[
        float | None, typer.Option(help="Lease of the ttl policy, seconds (default 10).")
    ] = None,
    api_keys: Annotated[
        Path | None, typer.Option(help="API keys -> tenants file (JSON, or 'key tenant' lines).")
    ] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Cap on the model context.")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="Most sequences in a batch.")] = None,
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
    max_sessions_per_tenant: Annotated[int, typer.Option(help="Open sessions per tenant.")] = 256,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body, bytes.")] = 4 << 20,
    poison_freed_blocks: Annotated[
        bool,
        typer.Option(
            help="Overwrite every freed KV block with NaN, so a stale read shows (a check)."
        ),
    ] = False,
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
    from kvpilot.cli.checks import for_flag as flag
    from kvpilot.server.limits import ServerLimits

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    try:  # everything is checked before anything is loaded
        check_checkpoint(model)
        check_device(device)
        if dtype is not None:
            check_choice(dtype, DTYPE_NAMES, "--dtype")
        options = ServeOptions(
            model=model,
            kv_memory_bytes=flag("--kv-memory", lambda: _size(kv_memory)),
            kv_blocks=kv_blocks,
            host_memory_bytes=flag("--host-memory", lambda: _size(host_memory)),
            disk_dir=disk_dir,
            disk_blocks=disk_blocks,
            policy=policy,
            pause_ttl_s=pause_ttl,
            api_keys=api_keys,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            device=device,
            dtype=dtype,
            poison_freed_blocks=poison_freed_blocks,
            attention=attention,
            gpu_memory_utilization=gpu_memory_utilization,
            limits=ServerLimits(
                max_tokens_limit=max_tokens_limit,
                max_n=max_n,
                max_sessions_per_tenant=max_sessions_per_tenant,
                max_body_bytes=max_body_bytes,
            ),
            prices=prices,
            usage_dir=usage_dir,
            prompt_cache_min_tokens=prompt_cache_min_tokens,
        )
    except KvpilotError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    if replicas > 1 or ray_address is not None:
        from kvpilot.fleet.serve.deploy import FleetOptions, deploy

        try:
            fleet = FleetOptions(
                replicas=replicas, router=router, ray_address=ray_address, host=host, port=port
            )
            deploy(options, fleet)
        except KvpilotError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(code=2) from exc
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

    banner.listening(f"http://{host}:{port}")
    uvicorn.run(app, host=host, port=port, log_level="info")
