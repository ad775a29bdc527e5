"""`kvpilot calibrate`: measure the real engine's per-step cost on this machine and fit a
simulator profile, then check it against a replay on both.

With a check, the calibration steps run interleaved with the real replays
(`kvpilot.sim.paired`): on a shared machine whose speed drifts, a fit and a replay measured one
after the other see different machines, and the error would mostly say how far it drifted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvpilot.cli.sim_support import (
    HELP_CALLS,
    HELP_HEAD_TOKENS,
    HELP_MAX_CALL_TOKENS,
    HELP_MAX_OUTPUT_TOKENS,
    HELP_SESSIONS,
    default_miniswe_dir,
    resolve_trace_paths,
)
from kvpilot.errors import KvpilotError

if TYPE_CHECKING:
    from rich.console import Console

    from kvpilot.sim.profile import StepProfile
    from kvpilot.sim.replay import ReplayOptions


def _fail(exc: KvpilotError) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(code=2)


def calibrate(
    model: Annotated[str, typer.Option(help="Checkpoint folder or 'tiny'.")] = "tiny",
    out: Annotated[Path, typer.Option(help="Where to write the JSON profile.")] = Path(
        "kvpilot-profile.json"
    ),
    kv_blocks: Annotated[int, typer.Option(help="KV pool blocks of the measured engine.")] = 2048,
    quick: Annotated[bool, typer.Option(help="Fewer batches (a rougher fit).")] = False,
    threads: Annotated[int, typer.Option(help="Torch CPU threads while measuring.")] = 1,
    check: Annotated[
        bool, typer.Option(help="Replay a trace on both and compare (default: miniswe).")
    ] = True,
    trace: Annotated[list[str] | None, typer.Option(help="Trace for --check.")] = None,
    passes: Annotated[
        int,
        typer.Option(
            help="Real replays for --check, interleaved with the calibration steps (more "
            "if one whole calibration plan has not run by then).",
            min=1,
        ),
    ] = 2,
    sessions: Annotated[int | None, typer.Option(help=HELP_SESSIONS)] = 2,
    calls: Annotated[int | None, typer.Option(help=HELP_CALLS)] = None,
    max_call_tokens: Annotated[
        int | None,
        typer.Option(help=HELP_MAX_CALL_TOKENS + " Default: the model's limit less the output."),
    ] = None,
    head_tokens: Annotated[int | None, typer.Option(help=HELP_HEAD_TOKENS)] = None,
    max_output_tokens: Annotated[int | None, typer.Option(help=HELP_MAX_OUTPUT_TOKENS)] = 32,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Measure the real engine's per-step cost on this machine and fit a simulator profile."""
    from rich.console import Console
    from rich.progress import Progress

    from kvpilot.sim import calibrate as cal
    from kvpilot.sim.replay import ReplayOptions

    console = Console(stderr=as_json)
    try:
        paths = resolve_trace_paths(trace) if trace else None
        if check and paths is None and default_miniswe_dir() is not None:
            paths = [default_miniswe_dir()]  # type: ignore[list-item]
        limits = ReplayOptions(
            max_sessions=sessions,
            max_calls=calls,
            max_call_tokens=max_call_tokens,
            head_tokens=head_tokens,
            max_output_tokens=max_output_tokens,
            min_calls=3,
        )
        checked: dict[str, Any] | None = None
        if check and paths:
            profile, checked = _calibrate_checked(
                model, paths, limits, kv_blocks, quick, threads, passes, console, as_json
            )
        else:
            with Progress(console=console, transient=True, disable=as_json) as bar:
                task = bar.add_task("calibrating", total=None)
                profile = cal.calibrate(
                    model,
                    kv_blocks=kv_blocks,
                    quick=quick,
                    threads=threads,
                    on_progress=lambda i, n: bar.update(task, completed=i, total=n),
                )
        profile.save(out)
        result: dict[str, Any] = {"profile": str(out), **profile.to_json()}
        if checked is not None:
            result["check"] = checked
    except KvpilotError as exc:
        raise _fail(exc) from exc
    if as_json:
        typer.echo(json.dumps(result))
        return
    coeffs = result["coefficients_s"]
    console.print(
        f"wrote {out}: step = {coeffs['const'] * 1e3:.2f} ms + "
        f"{coeffs['prefill_tokens'] * 1e6:.1f} us/prefill token + "
        f"{coeffs['decode_seqs'] * 1e6:.1f} us/decode + "
        f"{coeffs['kv_read_tokens'] * 1e9:.1f} ns/KV token read + "
        f"{coeffs['attention_pairs'] * 1e9:.2f} ns/attention pair + "
        f"{coeffs['distinct_kv_tokens'] * 1e9:.1f} ns/distinct KV token read "
        f"({profile.samples} steps up to {profile.max_context_tokens:,} tokens of context, "
        f"R^2 {profile.r2:.3f}, median error {profile.median_rel_error:.1%})"
    )
    if "check" in result:
        c = result["check"]
        each = ", ".join(f"{e:+.1%}" for e in c["pass_errors"])
        console.print(
            f"replay check ({c['calls']} calls, prompts {c['prompt_tokens_min']:,}-"
            f"{c['prompt_tokens_max']:,} tokens, {c['passes']} real passes interleaved with the "
            f"calibration): real {c['real_tokens_per_s']:,.0f} tok/s, "
            f"simulated {c['sim_tokens_per_s']:,.0f} tok/s (error {c['throughput_error']:.1%}; "
            f"per pass {each}); hit rate real {c['real_hit_rate']:.1%}, "
            f"simulated {c['sim_hit_rate']:.1%} (CPU time)"
        )


def _calibrate_checked(
    model: str,
    paths: list[Path],
    limits: ReplayOptions,
    kv_blocks: int,
    quick: bool,
    threads: int,
    passes: int,
    console: Console,
    as_json: bool,
) -> tuple[StepProfile, dict[str, Any]]:
    """Calibrate interleaved with ``passes`` real replays of the trace at ``paths``; the
    profile and the check: all passes together and each pass's signed error."""
    from rich.progress import Progress

    from kvpilot.sim import calibrate as cal
    from kvpilot.sim import paired
    from kvpilot.sim.measured import model_limit
    from kvpilot.sim.replay import load_replay

    cap = limits.max_call_tokens
    if cap is None:
        cap = model_limit(model, kv_blocks=kv_blocks) - (limits.max_output_tokens or 1)
    options = dataclasses.replace(limits, tokenize=cal.tokenizer_of(model), max_call_tokens=cap)
    replay = load_replay(paths, options)
    with Progress(console=console, transient=True, disable=as_json) as bar:
        task = bar.add_task("calibrating alongside real replays", total=passes)
        measured = paired.calibrate_with_replays(
            {"check": replay},
            model,
            kv_blocks=kv_blocks,
            quick=quick,
            passes=passes,
            threads=threads,
            on_pass=lambda done: bar.update(task, completed=done),
        )
    check = measured.checks["check"]
    return measured.profile, {
        **check.total.to_json(),
        "passes": len(check.passes),
        "pass_errors": check.pass_errors,
        "steady_errors": check.steady_errors,
    }
