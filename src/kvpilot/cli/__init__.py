"""The `kvpilot` command line. Each subcommand lives in its own module and registers here.

Importing this package must stay cheap (`kvpilot --help` answers in well under a second):
the command modules import only typer and light kvpilot modules at the top, and everything
heavy (torch, FastAPI, matplotlib, numpy, rich tables) inside the command that needs it.
"""

from __future__ import annotations

import json
from functools import partial
from typing import TYPE_CHECKING, Annotated

import typer

from kvpilot.cli.help import Command, Group
from kvpilot.errors import KvpilotError

if TYPE_CHECKING:
    from kvpilot.sizing.geometry import ModelGeometry

app = typer.Typer(
    cls=Group,
    add_completion=False,
    no_args_is_help=True,
    help="kvpilot: an agent-aware LLM serving engine built around its KV-cache manager.",
)


def _fail(exc: KvpilotError) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(code=2)


def model_geometry(model: str, kv_dtype: str | None, weights_dtype: str | None) -> ModelGeometry:
    """The geometry `plan` and `sim` size, each mistake named by its flag."""
    from kvpilot.cli.checks import for_flag
    from kvpilot.sizing.geometry import normalize_dtype, normalize_weight_dtype, resolve_geometry

    if kv_dtype is not None:
        for_flag("--kv-dtype", partial(normalize_dtype, kv_dtype))
    if weights_dtype is not None:
        for_flag("--weights-dtype", partial(normalize_weight_dtype, weights_dtype))
    return for_flag("--model", partial(resolve_geometry, model, kv_dtype, weights_dtype))


@app.command(cls=Command)
def plan(
    model: Annotated[str, typer.Option(help="Preset name or path to a config.json.")] = (
        "llama-3-70b"
    ),
    node: Annotated[
        str, typer.Option(help="COUNTxACCELERATOR, e.g. 8xh100, 4xb200, 8xmi300x.")
    ] = "8xh100",
    tp: Annotated[
        int | None,
        typer.Option(
            help="Tensor parallel degree (default: the smallest that fits; replicas fill the node)."
        ),
    ] = None,
    kv_dtype: Annotated[
        str | None, typer.Option(help="KV cache dtype: bf16, fp16, fp8, fp32.")
    ] = None,
    weights_dtype: Annotated[
        str | None, typer.Option(help="Weights dtype: bf16, fp16, fp8, int8, int4.")
    ] = None,
    context: Annotated[
        list[int] | None,
        typer.Option(help="Context tokens, repeatable (default: 8192, 32768, 131072)."),
    ] = None,
    shared: Annotated[int, typer.Option(help="Shared prefix tokens (eq. 7).")] = 24576,
    output: Annotated[int, typer.Option(help="Output tokens per trajectory (K_avg).")] = 0,
    headroom: Annotated[float, typer.Option(help="Pool fraction kept free.")] = 0.0,
    reserve: Annotated[str, typer.Option(help="Runtime reserve per device, e.g. 2.5GB.")] = "2.5GB",
    weights: Annotated[
        str | None, typer.Option(help="Weights of one model copy, e.g. 140GB.")
    ] = None,
    hbm: Annotated[str | None, typer.Option(help="Memory per device, e.g. 80GB or 80GiB.")] = None,
    block_size: Annotated[
        list[int] | None, typer.Option(help="Tokens per block, repeatable (default: 16).")
    ] = None,
    seqs: Annotated[int, typer.Option(help="Sequences for the tail-waste estimate.")] = 256,
    pause: Annotated[str | None, typer.Option(help="Price a tool wait, e.g. 45s or 2m.")] = None,
    mfu: Annotated[float, typer.Option(help="Prefill model FLOPs utilization.")] = 0.45,
    link_bw: Annotated[str | None, typer.Option(help="Host link per device, e.g. 64GB/s.")] = None,
    nvme_bw: Annotated[
        str | None, typer.Option(help="NVMe bandwidth per node, e.g. 7GB/s.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Size KV memory: bytes per token, pool, concurrency, blocks, and the pause decision."""
    from rich.console import Console

    from kvpilot.cli.checks import for_flag
    from kvpilot.cli.format import render_plan, to_jsonable
    from kvpilot.sizing.hardware import parse_node
    from kvpilot.sizing.plan import DEFAULT_BLOCK_SIZES, DEFAULT_CONTEXTS, PlanConfig, make_plan
    from kvpilot.units import parse_bytes, parse_duration

    def opt(text: str | None, flag: str) -> float | None:
        return None if text is None else parse_bytes(text, flag)

    try:
        geometry = model_geometry(model, kv_dtype, weights_dtype)
        hbm_bytes = opt(hbm, "--hbm")
        the_node = for_flag("--node", partial(parse_node, node)).with_overrides(
            hbm_bytes=None if hbm_bytes is None else int(hbm_bytes),
            host_link_bw_bytes_s=opt(link_bw, "--link-bw"),
            nvme_bw_bytes_s=opt(nvme_bw, "--nvme-bw"),
        )
        result = make_plan(
            PlanConfig(
                geometry=geometry,
                node=the_node,
                tp=tp,
                contexts=tuple(context) if context else DEFAULT_CONTEXTS,
                shared_tokens=shared,
                output_tokens=output,
                headroom=headroom,
                reserve_bytes_per_device=parse_bytes(reserve, "--reserve"),
                weight_bytes=opt(weights, "--weights"),
                block_sizes=tuple(block_size) if block_size else DEFAULT_BLOCK_SIZES,
                num_seqs=seqs,
                pause_s=None if pause is None else parse_duration(pause, "--pause"),
                mfu=mfu,
            )
        )
    except KvpilotError as exc:
        raise _fail(exc) from exc
    if as_json:
        typer.echo(json.dumps(to_jsonable(result)))
    else:
        render_plan(result, Console())


@app.command(cls=Command)
def frag(
    pool: Annotated[str, typer.Option(help="KV pool size.")] = "10GiB",
    token_bytes: Annotated[str, typer.Option(help="KV bytes per token.")] = "160KiB",
    max_tokens: Annotated[int, typer.Option(help="S_max, the static reservation.")] = 16384,
    mean: Annotated[float, typer.Option(help="Mean sequence length (lognormal).")] = 2048,
    sigma: Annotated[float, typer.Option(help="Lognormal sigma.")] = 1.0,
    lengths: Annotated[
        str | None, typer.Option(help="Comma-separated lengths instead of lognormal.")
    ] = None,
    rounds: Annotated[int, typer.Option(help="Churn rounds (0: fill once).")] = 200,
    departure: Annotated[float, typer.Option(help="Share of requests leaving per round.")] = 0.1,
    block_size: Annotated[int, typer.Option(help="Paged block size (tokens).")] = 16,
    request: Annotated[str, typer.Option(help="Request size probed for Φ_ext.")] = "1.5GiB",
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Compare static, buddy and paged KV allocators: efficiency, fragmentation, concurrency."""
    from rich.console import Console

    from kvpilot.cli.format import render_frag, to_jsonable
    from kvpilot.errors import ConfigError
    from kvpilot.sizing.frag_lab import Workload, compare_allocators, spec_scenarios
    from kvpilot.units import parse_bytes

    try:
        try:
            length_list = (
                tuple(int(x) for x in lengths.split(",") if x.strip()) if lengths else None
            )
        except ValueError as exc:
            raise ConfigError(
                f"--lengths takes integers separated by commas, got {lengths!r}"
            ) from exc
        workload = Workload(mean, sigma, max_tokens, rounds, departure, seed, length_list)
        pool_bytes = int(parse_bytes(pool, "--pool"))
        tok = int(parse_bytes(token_bytes, "--token-bytes"))
        reports = compare_allocators(
            pool_bytes, tok, workload, block_size, int(parse_bytes(request, "--request"))
        )
    except KvpilotError as exc:
        raise _fail(exc) from exc
    scenarios = spec_scenarios()
    if as_json:
        payload = {"workload": workload, "allocators": reports, "spec_napkin_0_2": scenarios}
        typer.echo(json.dumps(to_jsonable(payload)))
        return
    source = "lengths " + lengths if lengths else f"lognormal mean {mean:,.0f} sigma {sigma:g}"
    title = (
        f"{pool_bytes / (1 << 30):g} GiB pool, {tok / 1024:g} KiB/token, S_max {max_tokens:,}, "
        f"{source}, means over {rounds} rounds"
    )
    render_frag(reports, title, scenarios, Console())


@app.command(cls=Command)
def demo(
    model: Annotated[str, typer.Option(help="Checkpoint folder, or the built-in tiny.")] = "tiny",
) -> None:
    """The main job on built-in defaults: plan, frag, then `kvpilot serve` with agent sessions."""
    from rich.console import Console

    from kvpilot.cli.checks import check_checkpoint

    try:
        check_checkpoint(model)  # the demo's one option: checked before any work
    except KvpilotError as exc:
        raise _fail(exc) from exc
    console = Console()
    console.rule("[bold]kvpilot plan: Llama-3-70B on 8xH100, 8k/32k/128k, a 45 s pause")
    plan(pause="45s")
    console.rule("[bold]kvpilot frag: static vs buddy vs paged allocation")
    frag()
    try:
        from kvpilot.demo.run import run_engine_demo

        run_engine_demo(console, model)
    except KvpilotError as exc:
        raise _fail(exc) from exc


def _register_optional_commands() -> None:
    from kvpilot.cli.calibrate import calibrate
    from kvpilot.cli.serve import serve
    from kvpilot.cli.sim import sim
    from kvpilot.cli.top import top
    from kvpilot.cli.trace import trace_analyze

    app.command("serve", cls=Command)(serve)
    app.command(cls=Command)(top)
    app.command(cls=Command)(sim)
    app.command(cls=Command)(calibrate)
    trace_app = typer.Typer(cls=Group, no_args_is_help=True, help="Diagnose agent traces.")
    trace_app.command("analyze", cls=Command)(trace_analyze)
    app.add_typer(trace_app, name="trace")


_register_optional_commands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
