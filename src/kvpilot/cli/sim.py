"""`kvpilot sim`, `kvpilot calibrate` and `kvpilot trace analyze`: command functions.

Registered in `kvpilot.cli` with one line each::

    app.command()(sim)
    app.command()(calibrate)
    trace_app.command("analyze")(trace_analyze)   # trace_app: typer.Typer(), added as "trace"
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvpilot.cli.checks import for_flag
from kvpilot.errors import ConfigError, KvpilotError
from kvpilot.units import parse_duration

if TYPE_CHECKING:
    from rich.console import Console

MINISWE_RELATIVE = Path("traces") / "lmcache-agent-trace" / "miniswe"


def default_miniswe_dir() -> Path | None:
    """``../shared/traces/lmcache-agent-trace/miniswe`` next to the repository, if present."""
    root = Path(__file__).resolve().parents[3]
    for base in (root.parent / "shared", root / "shared"):
        if (base / MINISWE_RELATIVE).is_dir():
            return base / MINISWE_RELATIVE
    return None


def resolve_trace_paths(paths: list[str]) -> list[Path]:
    out = []
    for p in paths:
        if p.lower() == "miniswe":
            found = default_miniswe_dir()
            if found is None:
                raise ConfigError(
                    "no miniswe traces next to the repository (../shared/traces/"
                    "lmcache-agent-trace/miniswe); give the folder's path instead"
                )
            out.append(found)
        else:
            out.append(Path(p))
    return out


def _tokenizer(path: str | None) -> Any:
    if path is None:
        return None
    from kvpilot.sim.calibrate import tokenizer_of

    return tokenizer_of(path)


def _fail(exc: KvpilotError) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(code=2)


def sim(
    model: Annotated[str, typer.Option(help="Model preset or config.json path.")] = "llama-3-70b",
    node: Annotated[str, typer.Option(help="COUNTxACCELERATOR, e.g. 8xh100.")] = "8xh100",
    tp: Annotated[int | None, typer.Option(help="Tensor parallel degree (default: all).")] = None,
    workload: Annotated[
        Path | None, typer.Option(help="Agent workload YAML (default: built-in agent mix).")
    ] = None,
    trace: Annotated[
        list[str] | None,
        typer.Option(help="Replay a trace file/folder instead ('miniswe': the shared traces)."),
    ] = None,
    policy: Annotated[
        str, typer.Option(help="breakeven, retain, drop, offload-host, ttl, lru, tau-X, ...")
    ] = "breakeven",
    compare_policies: Annotated[
        bool, typer.Option("--compare-policies", help="Run several policies on the same seed.")
    ] = False,
    policies: Annotated[
        str | None, typer.Option(help="Comma-separated policies for --compare-policies.")
    ] = None,
    duration: Annotated[str, typer.Option(help="Simulated time: 3600, 30m, 1h.")] = "1h",
    seed: Annotated[int | None, typer.Option(help="Workload seed (overrides the YAML).")] = None,
    kv_blocks: Annotated[
        int | None, typer.Option(help="KV pool blocks (default: what plan leaves).")
    ] = None,
    reserve_gb: Annotated[float, typer.Option(help="Runtime reserve per device (GB).")] = 2.5,
    host_kv_gb: Annotated[
        float | None,
        typer.Option(help="Host KV tier per device (GB; default half its host memory; 0: none)."),
    ] = None,
    mfu: Annotated[float, typer.Option(help="Achieved fraction of peak FLOP/s.")] = 0.5,
    hbm_efficiency: Annotated[float, typer.Option(help="Achieved fraction of HBM BW.")] = 0.8,
    step_overhead_ms: Annotated[float, typer.Option(help="Fixed host cost per step.")] = 1.0,
    profile: Annotated[
        Path | None, typer.Option(help="Step profile from `kvpilot calibrate` (not roofline).")
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Running sequences at most.")] = 256,
    max_batched_tokens: Annotated[int, typer.Option(help="Token budget per step.")] = 2048,
    prefill_chunk: Annotated[int, typer.Option(help="Prefill chunk per sequence.")] = 512,
    tau_high: Annotated[float, typer.Option(help="Admission ceiling on KV usage.")] = 0.9,
    max_model_len: Annotated[int, typer.Option(help="Model context length.")] = 131072,
    sample_interval: Annotated[float, typer.Option(help="Telemetry sample period (s).")] = 1.0,
    time_scale: Annotated[float, typer.Option(help="Replay: scale trace timestamps.")] = 1.0,
    tokenizer: Annotated[
        str | None, typer.Option(help="Replay: tokenizer folder (default: chars/token).")
    ] = None,
    chars_per_token: Annotated[int, typer.Option(help="Replay: chars per token estimate.")] = 4,
    hash_block_tokens: Annotated[int, typer.Option(help="Hashed traces: tokens/hash.")] = 16,
    timestamp_unit: Annotated[str, typer.Option(help="Hashed traces: s, ms or us.")] = "s",
    out: Annotated[Path | None, typer.Option(help="Write PNG figures and JSON here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Simulate agent serving on virtual time with the engine's own scheduler and memory."""
    import dataclasses

    from rich.console import Console

    from kvpilot.engine.config import EngineConfig
    from kvpilot.sim.build import SimSetup, run_simulation
    from kvpilot.sim.policies import DEFAULT_COMPARISON, resolve_policy
    from kvpilot.sim.replay import ReplayOptions, load_replay
    from kvpilot.sim.report import print_comparison, print_result
    from kvpilot.sim.workload import WorkloadConfig
    from kvpilot.sizing.geometry import resolve_geometry
    from kvpilot.sizing.hardware import parse_node

    console = Console(stderr=as_json)
    try:
        # Validate first: a bad name fails here, not after minutes of loading or simulating.
        for_flag("--model", partial(resolve_geometry, model))
        for_flag("--node", partial(parse_node, node))
        names = [policy]
        if compare_policies:
            chosen = policies.split(",") if policies else list(DEFAULT_COMPARISON)
            names = list(dict.fromkeys([policy, *(p.strip() for p in chosen if p.strip())]))
        flag = "--policies" if compare_policies and policies else "--policy"
        for name in names:
            for_flag(flag, partial(resolve_policy, name))
        seconds = for_flag("--duration", partial(parse_duration, duration))
        setup = SimSetup(
            model=model,
            node=node,
            tp=tp,
            kv_blocks=kv_blocks,
            reserve_bytes_per_device=reserve_gb * 1e9,
            host_kv_bytes_per_device=None if host_kv_gb is None else host_kv_gb * 1e9,
            mfu=mfu,
            hbm_efficiency=hbm_efficiency,
            step_overhead_s=step_overhead_ms / 1e3,
            profile=profile,
            engine=EngineConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_batched_tokens,
                max_prefill_chunk=prefill_chunk,
                tau_high=tau_high,
            ),
            max_model_len=max_model_len,
            duration_s=seconds,
            sample_interval_s=sample_interval,
        )
        vocab = 32000
        load: WorkloadConfig | list[Any]
        if trace:
            load = load_replay(
                resolve_trace_paths(trace),
                ReplayOptions(
                    vocab_size=vocab,
                    tokenize=_tokenizer(tokenizer),
                    chars_per_token=chars_per_token,
                    hash_block_tokens=hash_block_tokens,
                    timestamp_unit=timestamp_unit,
                ),
            )
            # A real tokenizer may use ids past the synthetic vocabulary.
            vocab = max(vocab, 1 + max(max(c.prompt) for s in load for c in s.calls))
        else:
            load = WorkloadConfig.from_yaml(workload) if workload else WorkloadConfig.default()
            if seed is not None:
                load = dataclasses.replace(load, seed=seed)
        results = []
        for k, name in enumerate(names, 1):
            label = f"policy {k}/{len(names)}: {name}" if len(names) > 1 else name
            with _progress(console, seconds, label, quiet=as_json) as update:
                results.append(
                    run_simulation(
                        setup,
                        load,
                        policy=name,
                        time_scale=time_scale,
                        vocab_size=vocab,
                        on_progress=update,
                    )
                )
    except KvpilotError as exc:
        raise _fail(exc) from exc
    if out is not None:
        _write_figures(out, setup, results, console)
    if as_json:
        payload: Any = [r.summary() for r in results]
        typer.echo(json.dumps(payload[0] if len(payload) == 1 else payload, default=_jsonable))
        return
    for r in results:
        print_result(console, r)
    if len(results) > 1:
        print_comparison(console, results)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


class _progress:
    """A rich progress bar over simulated seconds (a no-op when quiet)."""

    def __init__(self, console: Console, total_s: float, label: str, quiet: bool) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.quiet = quiet
        self.total = total_s
        self.bar = Progress(
            TextColumn(f"[bold]sim {label}"),
            BarColumn(),
            TextColumn("{task.completed:,.0f}/{task.total:,.0f} s simulated"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self.task = self.bar.add_task(label, total=total_s)

    def __enter__(self) -> Any:
        if self.quiet:
            return None
        self.bar.start()
        return lambda now: self.bar.update(self.task, completed=min(now, self.total))

    def __exit__(self, *exc: object) -> None:
        if not self.quiet:
            self.bar.stop()


def _write_figures(out: Path, setup: Any, results: list[Any], console: Console) -> None:
    from kvpilot.sim import plots

    out.mkdir(parents=True, exist_ok=True)
    first = results[0]
    written = [
        plots.plot_kv_usage(first, out / "kv_usage.png", setup.engine.tau_high),
        plots.plot_latency(first, out / "latency.png"),
    ]
    if len(results) > 1:
        written.append(plots.plot_policy_comparison(results, out / "policies.png"))
        for r in results[1:]:
            written.append(
                plots.plot_kv_usage(r, out / f"kv_usage-{r.label}.png", setup.engine.tau_high)
            )
    if setup.profile is None:
        geometry, node_obj = setup.geometry(), setup.parsed_node()
        written.append(
            plots.plot_breakeven(geometry, node_obj, setup.tp_degree(), out / "breakeven.png")
        )
        peak = float(first.samples["resident"].max()) if len(first.samples["resident"]) else 0.0
        written.append(
            plots.plot_capacity(
                geometry,
                [node_obj],
                out / "capacity.png",
                reserve_bytes_per_device=setup.reserve_bytes_per_device,
                observed={f"sim peak holding KV ({first.label})": peak} if peak else None,
            )
        )
    (out / "summary.json").write_text(
        json.dumps([r.summary() for r in results], indent=2, default=_jsonable) + "\n"
    )
    for path in written:
        console.print(f"wrote {path}")


def calibrate(
    model: Annotated[str, typer.Option(help="Checkpoint folder or 'tiny'.")] = "tiny",
    out: Annotated[Path, typer.Option(help="Where to write the JSON profile.")] = Path(
        "kvpilot-profile.json"
    ),
    kv_blocks: Annotated[int, typer.Option(help="KV pool blocks of the measured engine.")] = 2048,
    quick: Annotated[bool, typer.Option(help="Fewer batches (a rougher fit).")] = False,
    threads: Annotated[int, typer.Option(help="Torch CPU threads while measuring.")] = 1,
    check: Annotated[
        bool, typer.Option(help="Replay miniswe on both and compare (needs the traces).")
    ] = True,
    trace: Annotated[list[str] | None, typer.Option(help="Trace for --check.")] = None,
    sessions: Annotated[int, typer.Option(help="--check: sessions replayed.")] = 2,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Measure the real engine's per-step cost on this machine and fit a simulator profile."""
    from rich.console import Console
    from rich.progress import Progress

    from kvpilot.sim import calibrate as cal
    from kvpilot.sim.replay import ReplayOptions, load_replay

    console = Console(stderr=as_json)
    try:
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
        paths = resolve_trace_paths(trace) if trace else None
        if check and paths is None and default_miniswe_dir() is not None:
            paths = [default_miniswe_dir()]  # type: ignore[list-item]
        if check and paths:
            replay = load_replay(
                paths,
                ReplayOptions(
                    vocab_size=32000,
                    tokenize=cal.tokenizer_of(model),
                    head_tokens=1024,
                    max_call_tokens=2048,
                    max_output_tokens=32,
                    max_sessions=sessions,
                    min_calls=3,
                ),
            )
            outcome = cal.check_replay(profile, replay, model=model, kv_blocks=kv_blocks)
            result["check"] = outcome.to_json()
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
        f"{coeffs['attention_pairs'] * 1e9:.2f} ns/attention pair "
        f"({profile.samples} steps, R^2 {profile.r2:.3f}, "
        f"median error {profile.median_rel_error:.1%})"
    )
    if "check" in result:
        c = result["check"]
        console.print(
            f"replay check ({c['calls']} calls): real {c['real_tokens_per_s']:,.0f} tok/s, "
            f"simulated {c['sim_tokens_per_s']:,.0f} tok/s (error {c['throughput_error']:.1%}); "
            f"hit rate real {c['real_hit_rate']:.1%}, simulated {c['sim_hit_rate']:.1%}"
        )


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

    from kvpilot.trace.analyze import (
        DEFAULT_ZONES,
        diagnose,
        load_zone_markers,
        render_diagnosis,
    )
    from kvpilot.trace.schema import load_trace_inputs

    console = Console()
    try:
        calls = load_trace_inputs(
            files,
            tokenize=_tokenizer(tokenizer),
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
