"""`kvpilot sim`: simulate agent serving on virtual time (registered in `kvpilot.cli`;
`kvpilot calibrate` is in `kvpilot.cli.calibrate`, `kvpilot trace analyze` in
`kvpilot.cli.trace`).

Sizes carry units (``--reserve 2.5GB``, ``--host-memory 64GiB``); the engine knobs are the
flags of ``kvpilot serve`` (`kvpilot.cli.options`: ``--block-size``, ``--max-batched-tokens``,
``--tau-high``, ...); the replay
limits (``--sessions``, ``--calls``, ``--max-call-tokens``, ``--head-tokens``,
``--max-output-tokens``) are the same on ``sim`` and ``calibrate``.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvpilot.cli.checks import for_flag
from kvpilot.cli.options import (
    BlockSize,
    KvBlocks,
    MaxBatchedTokens,
    MaxModelLen,
    MaxNumSeqs,
    PrefillChunk,
    TauHigh,
    engine_config,
    size,
)
from kvpilot.cli.sim_support import (
    HELP_CALLS,
    HELP_HEAD_TOKENS,
    HELP_MAX_CALL_TOKENS,
    HELP_MAX_OUTPUT_TOKENS,
    HELP_SESSIONS,
    jsonable,
    resolve_trace_paths,
    tokenizer_from,
    write_figures,
)
from kvpilot.cli.sim_support import progress as _progress
from kvpilot.errors import ConfigError, KvpilotError
from kvpilot.units import parse_bytes, parse_duration

if TYPE_CHECKING:
    from rich.console import Console


def _fail(exc: KvpilotError) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(code=2)


def sim(
    model: Annotated[str, typer.Option(help="Model preset or config.json path.")] = "llama-3-70b",
    node: Annotated[str, typer.Option(help="COUNTxACCELERATOR, e.g. 8xh100.")] = "8xh100",
    tp: Annotated[
        int | None,
        typer.Option(help="Tensor parallel degree (default: the smallest that fits, as plan)."),
    ] = None,
    kv_dtype: Annotated[
        str | None, typer.Option(help="KV cache dtype: bf16, fp16, fp8, fp32.")
    ] = None,
    weights_dtype: Annotated[
        str | None, typer.Option(help="Weights dtype: bf16, fp16, fp8, int8, int4.")
    ] = None,
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
    kv_blocks: KvBlocks = None,
    reserve: Annotated[str, typer.Option(help="Runtime reserve per device, e.g. 2.5GB.")] = "2.5GB",
    host_memory: Annotated[
        str | None,
        typer.Option(
            "--host-memory",
            "--host-kv",
            help="Host KV tier per device, e.g. 64GiB (default: half its host memory; 0: none).",
        ),
    ] = None,
    mfu: Annotated[float, typer.Option(help="Achieved fraction of peak FLOP/s.")] = 0.5,
    hbm_efficiency: Annotated[float, typer.Option(help="Achieved fraction of HBM BW.")] = 0.8,
    step_overhead: Annotated[str, typer.Option(help="Fixed host cost per step, e.g. 1ms.")] = "1ms",
    profile: Annotated[
        Path | None, typer.Option(help="Step profile from `kvpilot calibrate` (not roofline).")
    ] = None,
    block_size: BlockSize = None,
    max_num_seqs: MaxNumSeqs = 256,
    max_batched_tokens: MaxBatchedTokens = None,
    prefill_chunk: PrefillChunk = None,
    tau_high: TauHigh = None,
    max_model_len: MaxModelLen = None,
    sample_interval: Annotated[str, typer.Option(help="Telemetry sample period, e.g. 1s.")] = "1s",
    time_scale: Annotated[float, typer.Option(help="Replay: scale trace timestamps.")] = 1.0,
    sessions: Annotated[int | None, typer.Option(help=HELP_SESSIONS)] = None,
    calls: Annotated[int | None, typer.Option(help=HELP_CALLS)] = None,
    max_call_tokens: Annotated[int | None, typer.Option(help=HELP_MAX_CALL_TOKENS)] = None,
    head_tokens: Annotated[int | None, typer.Option(help=HELP_HEAD_TOKENS)] = None,
    max_output_tokens: Annotated[int | None, typer.Option(help=HELP_MAX_OUTPUT_TOKENS)] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="Replay: tokenizer folder (default: chars/token).")
    ] = None,
    chars_per_token: Annotated[int, typer.Option(help="Replay: chars per token estimate.")] = 4,
    hash_block_tokens: Annotated[int, typer.Option(help="Hashed traces: tokens/hash.")] = 16,
    timestamp_unit: Annotated[str, typer.Option(help="Hashed traces: s, ms or us.")] = "s",
    out: Annotated[Path | None, typer.Option(help="Write PNG figures and JSON here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    replicas: Annotated[int, typer.Option(help="Fleet: engine replicas behind a router.")] = 1,
    router: Annotated[
        str, typer.Option(help="Fleet router: kvpilot, round_robin, power_of_two, ...")
    ] = "kvpilot",
    compare_routers: Annotated[
        bool, typer.Option("--compare-routers", help="Fleet: run every router, plot them.")
    ] = False,
    routers: Annotated[
        str | None, typer.Option(help="Comma-separated routers for --compare-routers.")
    ] = None,
    event_delay_ms: Annotated[
        float, typer.Option(help="Fleet: delay of KV events and load reports to the router.")
    ] = 50.0,
    families: Annotated[int, typer.Option(help="Fleet: agent families (system prompts).")] = 8,
    family_skew: Annotated[float, typer.Option(help="Fleet: Zipf skew of families.")] = 0.0,
    router_mu: Annotated[float | None, typer.Option(help="kvpilot router: mu.")] = None,
    router_gamma: Annotated[float | None, typer.Option(help="kvpilot router: gamma.")] = None,
    router_l_max: Annotated[
        float | None, typer.Option(help="kvpilot router: L_max (tokens).")
    ] = None,
) -> None:
    """Simulate agent serving on virtual time with the engine's own scheduler and memory.

    With --replicas R (or --compare-routers), a fleet of R engines behind a router, routed
    by the same code as `kvpilot serve --replicas`.
    """
    import dataclasses

    from rich.console import Console

    from kvpilot.cli import model_geometry
    from kvpilot.sim.build import SimSetup, run_simulation
    from kvpilot.sim.policies import DEFAULT_COMPARISON, resolve_policy
    from kvpilot.sim.replay import ReplayOptions, load_replay
    from kvpilot.sim.report import print_comparison, print_result
    from kvpilot.sim.workload import WorkloadConfig
    from kvpilot.sizing.hardware import parse_node

    console = Console(stderr=as_json)
    try:
        # Validate first: a bad name fails here, not after minutes of loading or simulating.
        model_geometry(model, kv_dtype, weights_dtype)
        for_flag("--node", partial(parse_node, node))
        names = [policy]
        if compare_policies:
            chosen = policies.split(",") if policies else list(DEFAULT_COMPARISON)
            names = list(dict.fromkeys([policy, *(p.strip() for p in chosen if p.strip())]))
        flag = "--policies" if compare_policies and policies else "--policy"
        for name in names:
            for_flag(flag, partial(resolve_policy, name))
        seconds = for_flag("--duration", partial(parse_duration, duration, "--duration"))
        setup = SimSetup(
            model=model,
            node=node,
            tp=tp,
            kv_dtype=kv_dtype,
            weights_dtype=weights_dtype,
            kv_blocks=kv_blocks,
            reserve_bytes_per_device=parse_bytes(reserve, "--reserve"),
            host_kv_bytes_per_device=size(host_memory, "--host-memory"),
            mfu=mfu,
            hbm_efficiency=hbm_efficiency,
            step_overhead_s=parse_duration(step_overhead, "--step-overhead"),
            profile=profile,
            engine=engine_config(
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_batched_tokens,
                max_prefill_chunk=prefill_chunk,
                tau_high=tau_high,
            ),
            max_model_len=max_model_len,
            duration_s=seconds,
            sample_interval_s=parse_duration(sample_interval, "--sample-interval"),
        )
        setup.tp_degree()  # a bad --model, --node or --tp fails here, before any work
        limits = ReplayOptions(
            max_sessions=sessions,
            max_calls=calls,
            max_call_tokens=max_call_tokens,
            head_tokens=head_tokens,
            max_output_tokens=max_output_tokens,
        )
        if not trace and limits.describe() != "no limits":
            raise ConfigError(f"{limits.describe()}: replay limits apply to --trace replays")
        vocab = 32000
        load: WorkloadConfig | list[Any]
        if trace:
            load = load_replay(
                resolve_trace_paths(trace),
                dataclasses.replace(
                    limits,
                    vocab_size=vocab,
                    tokenize=tokenizer_from(tokenizer),
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
        if replicas > 1 or compare_routers:
            _fleet(
                setup, load, replicas, router, compare_routers, routers, event_delay_ms,
                families, family_skew, (router_mu, router_gamma, router_l_max), policy,
                time_scale, vocab, out, as_json, console,
            )  # fmt: skip
            return
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
        if out is not None:
            write_figures(out, setup, results, console)
    except KvpilotError as exc:
        raise _fail(exc) from exc
    if as_json:
        payload: Any = [r.summary() for r in results]
        typer.echo(json.dumps(payload[0] if len(payload) == 1 else payload, default=jsonable))
        return
    for r in results:
        print_result(console, r)
    if len(results) > 1:
        print_comparison(console, results)


def _fleet(
    setup: Any,
    load: Any,
    replicas: int,
    router: str,
    compare: bool,
    routers: str | None,
    delay_ms: float,
    families: int,
    skew: float,
    knobs: tuple[float | None, float | None, float | None],
    policy: str,
    time_scale: float,
    vocab: int,
    out: Path | None,
    as_json: bool,
    console: Console,
) -> None:
    from kvpilot.fleet.scoring import RouterConfig
    from kvpilot.fleet.sim_cli import run_fleet_cli

    names = ("mu", "gamma", "l_max_tokens")
    given: dict[str, Any] = {k: v for k, v in zip(names, knobs, strict=True) if v is not None}
    run_fleet_cli(
        setup,
        load,
        replicas=replicas,
        router=router,
        compare_routers=compare,
        routers=routers,
        config=RouterConfig(**given),
        event_delay_s=delay_ms / 1e3,
        families=families,
        family_skew=skew,
        policy=policy,
        time_scale=time_scale,
        vocab_size=vocab,
        out=out,
        as_json=as_json,
        console=console,
    )
