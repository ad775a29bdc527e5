"""`kvpilot trace analyze`: diagnose a trace's prefix reuse (`kvpilot.trace.analyze`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvpilot.cli.sim_support import tokenizer_from
from kvpilot.errors import KvpilotError


def _fail(exc: KvpilotError) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(code=2)


def trace_analyze(
    files: Annotated[list[Path], typer.Argument(help="JSONL trace files or folders.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the diagnosis.")] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="Tokenizer folder (default: chars per token).")
    ] = None,
    chars_per_token: Annotated[int, typer.Option(help="Chars per token estimate.")] = 4,
    block_size: Annotated[int, typer.Option(help="KV block size (tokens).")] = 16,
    hash_block_tokens: Annotated[int, typer.Option(help="Hashed traces: tokens/hash.")] = 16,
    timestamp_unit: Annotated[str, typer.Option(help="Hashed traces: s, ms or us.")] = "s",
    zones: Annotated[
        Path | None, typer.Option(help="JSON zone markers [{zone, marker, after}].")
    ] = None,
    turns: Annotated[bool, typer.Option(help="Also print every call.")] = False,
    top: Annotated[int, typer.Option(help="Rows per table (sessions, breaks).", min=1)] = 10,
) -> None:
    """Diagnose a trace's prefix reuse: hits vs ideal, why prompts diverge, tool waits."""
    from rich.console import Console

    from kvpilot.trace.analyze import DEFAULT_ZONES, diagnose, load_zone_markers
    from kvpilot.trace.report import render_diagnosis
    from kvpilot.trace.schema import load_trace_inputs

    console = Console()
    try:
        calls = load_trace_inputs(
            files,
            tokenize=tokenizer_from(tokenizer),
            chars_per_token=chars_per_token,
            hash_block_tokens=hash_block_tokens,
            timestamp_unit=timestamp_unit,
        )
        markers = load_zone_markers(zones) if zones else DEFAULT_ZONES
        diagnosis = diagnose(calls, block_size, markers)
    except KvpilotError as exc:
        raise _fail(exc) from exc
    if plot is not None:
        from kvpilot.sim.plots import plot_trace_diagnosis

        plot_trace_diagnosis(diagnosis, plot)
    if as_json:
        typer.echo(json.dumps(diagnosis.to_json()))
        return
    render_diagnosis(console, diagnosis, turns, top)
    if plot is not None:
        console.print(f"wrote {plot}")
