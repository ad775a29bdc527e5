"""``kvpilot serve``: build an engine from command-line options and serve it over HTTP."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from fastapi import FastAPI

from kvpilot.errors import ConfigError, ModelLoadError
from kvpilot.server.limits import ServerLimits
from kvpilot.server.tenancy import ApiKeys

PAUSE_POLICIES = ("breakeven",)

# EngineConfig fields that take the tier options, once the engine has them.
_TIER_FIELDS = {
    "host_memory_bytes": "host_memory_bytes",
    "disk_dir": "disk_dir",
    "policy": "pause_policy",
}


@dataclass(frozen=True, slots=True)
class ServeOptions:
    model: str = "tiny"
    kv_memory_bytes: int | None = None
    kv_blocks: int | None = None
    host_memory_bytes: int | None = None
    disk_dir: Path | None = None
    policy: str = "breakeven"
    api_keys: Path | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    device: str | None = None
    dtype: str | None = None
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)

    def __post_init__(self) -> None:
        if self.kv_memory_bytes is not None and self.kv_blocks is not None:
            raise ConfigError("give --kv-memory or --kv-blocks, not both")
        if self.policy not in PAUSE_POLICIES:
            raise ConfigError(f"--policy {self.policy!r} is unknown; known: {list(PAUSE_POLICIES)}")
        if self.host_memory_bytes is not None and self.host_memory_bytes <= 0:
            raise ConfigError("--host-memory must be positive")
        if self.disk_dir is not None:
            try:
                self.disk_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"--disk-dir {self.disk_dir}: cannot create it ({exc})") from exc
            if not os.access(self.disk_dir, os.W_OK):
                raise ConfigError(f"--disk-dir {self.disk_dir} is not writable")


def build_app(options: ServeOptions) -> FastAPI:
    """The engine and app ``kvpilot serve`` would run, without starting a server."""
    from kvpilot.engine import Engine, EngineConfig
    from kvpilot.server.app import create_app

    keys = ApiKeys.from_file(options.api_keys) if options.api_keys else ApiKeys()
    given = {
        "kv_blocks": options.kv_blocks,
        "kv_memory_bytes": options.kv_memory_bytes,
        "max_model_len": options.max_model_len,
        "max_num_seqs": options.max_num_seqs,
        "device": options.device,
        "dtype": options.dtype,
    }
    engine_options: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    tier_values = {
        "host_memory_bytes": options.host_memory_bytes,
        "disk_dir": str(options.disk_dir) if options.disk_dir else None,
        "policy": options.policy,
    }
    report: dict[str, Any] = dict(tier_values)
    pending = []
    for name, value in tier_values.items():
        if _TIER_FIELDS[name] in known:
            engine_options[_TIER_FIELDS[name]] = value
        elif value is not None:
            pending.append(name)
    report["tiers_applied"] = not pending
    if pending:
        report["note"] = (
            f"{', '.join(pending)} accepted and validated; the engine does not take them yet "
            "(device tier only until the tier work lands)"
        )
    engine = Engine.from_pretrained(options.model, **engine_options)
    return create_app(
        engine, model_name=options.model, limits=options.limits, api_keys=keys, options=report
    )


def _size(text: str | None) -> int | None:
    if text is None:
        return None
    from kvpilot.cli_format import parse_bytes

    return int(parse_bytes(text))


def serve(
    model: Annotated[str, typer.Option(help="Checkpoint folder, or 'tiny' (built in).")] = "tiny",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    kv_memory: Annotated[str | None, typer.Option(help="Device KV pool size, e.g. 2GiB.")] = None,
    kv_blocks: Annotated[int | None, typer.Option(help="Device KV pool in blocks.")] = None,
    host_memory: Annotated[str | None, typer.Option(help="Host tier size, e.g. 32GiB.")] = None,
    disk_dir: Annotated[Path | None, typer.Option(help="Folder for the disk tier.")] = None,
    policy: Annotated[str, typer.Option(help="Pause policy.")] = "breakeven",
    api_keys: Annotated[
        Path | None, typer.Option(help="API keys -> tenants file (JSON, or 'key tenant' lines).")
    ] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Cap on the model context.")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="Most sequences in a batch.")] = None,
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
    """Serve a model over an OpenAI-compatible HTTP API, with agent sessions and /metrics."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    try:
        options = ServeOptions(
            model=model,
            kv_memory_bytes=_size(kv_memory),
            kv_blocks=kv_blocks,
            host_memory_bytes=_size(host_memory),
            disk_dir=disk_dir,
            policy=policy,
            api_keys=api_keys,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            device=device,
            dtype=dtype,
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
