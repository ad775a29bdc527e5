"""Parsing and printing for the CLI: byte sizes with units, rich tables, JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table

from kvpilot.units import format_bytes, format_in, format_percent, to_jsonable

if TYPE_CHECKING:
    from kvpilot.sizing.frag_lab import FragReport, ScenarioResult
    from kvpilot.sizing.plan import Plan

__all__ = ["render_frag", "render_plan", "to_jsonable"]


def _gb(nbytes: float) -> str:
    return format_in(nbytes, "GB")


def _ms(seconds: float) -> str:
    return format_in(seconds, "ms", 0)


def render_plan(plan: Plan, console: Console) -> None:
    b, f = plan.budget, plan.footprint
    replicas = f" x {b.replicas} replicas" if b.replicas > 1 else ""
    console.print(
        f"[bold]{plan.model}[/] on [bold]{plan.node}[/], TP {b.tp}{replicas} · "
        f"weights {plan.weight_dtype}, KV {plan.kv_dtype}"
    )
    console.print(f"{plan.tp_reason}; {b.replicas} replica(s) on {b.devices} devices")
    limit = f"; context limit {plan.max_context_tokens:,} tokens" if plan.max_context_tokens else ""
    console.print(f"{plan.layers}{limit}")
    console.print(
        f"KV per token (eq. 1, whole model): [bold]{f.model_bytes:,} B[/]"
        + (f"; {f.device_bytes:,} B on each of the TP {b.tp} devices" if b.tp > 1 else "")
    )
    if f.window_cap_model_bytes or f.state_model_bytes:
        parts = [f"full-attention layers {f.full_model_bytes:,} B per token"]
        if f.window_cap_model_bytes:
            parts.append(
                f"window layers at most {format_bytes(f.window_cap_model_bytes)} per sequence"
            )
        if f.state_model_bytes:
            parts.append(f"linear layers {format_bytes(f.state_model_bytes)} of state per sequence")
        console.print("hybrid: " + ", ".join(parts) + " (capacity below counts it this way)")
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/] {warning}")

    memory = Table(title="Memory (eq. 3-5)", title_justify="left", box=box.SIMPLE_HEAD)
    memory.add_column("")
    memory.add_column("per device", justify="right")
    memory.add_column("TP group" if b.replicas > 1 else "node", justify="right")
    memory.add_row("KV per token (B)", f"{f.device_bytes:,}", f"{f.group_bytes:,}")
    per_group = b.tp if b.replicas > 1 else b.devices
    for label, dev in (
        ("HBM (GB)", b.hbm_bytes_per_device),
        ("weights (GB)", b.weight_bytes_per_device),
        ("reserve (GB)", b.reserve_bytes_per_device),
        ("KV pool (GB)", b.pool_bytes_per_device),
    ):
        memory.add_row(label, _gb(dev), _gb(dev * per_group))
    console.print(memory)

    capacity = Table(
        title=f"Trajectories per node (output {plan.output_tokens:,}, headroom "
        f"{format_percent(plan.headroom, 0)}%, shared {plan.shared_tokens:,} tokens)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        caption="-: the shared prefix is longer than the context"
        if any(r.shared is None for r in plan.capacity)
        else None,
        caption_justify="left",
    )
    for name in ("context (tokens)", "per trajectory (GB)", "cold (eq. 6)", "shared (eq. 7)"):
        capacity.add_column(name, justify="right")
    for row in plan.capacity:
        capacity.add_row(
            f"{row.context_tokens:,}",
            _gb(row.trajectory_bytes),
            f"{row.cold:,}",
            "-" if row.shared is None else f"{row.shared:,}",
        )
    console.print(capacity)

    blocks = Table(
        title=f"Paged blocks per device (tail waste at {plan.num_seqs:,} sequences)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in ("block (tokens)", "block (KiB)", "blocks", "tokens", "tail waste (%)"):
        blocks.add_column(name, justify="right")
    for block_row in plan.blocks:
        blocks.add_row(
            f"{block_row.block_size}",
            f"{block_row.block_bytes / 1024:,.0f}",
            f"{block_row.num_blocks:,}",
            f"{block_row.token_capacity:,}",
            format_percent(block_row.tail_waste_fraction, 2),
        )
    console.print(blocks)
    _render_pools(plan, console)

    if not plan.pauses:
        return
    assert plan.pause_s is not None
    pause = Table(
        title=f"Pause of {plan.pause_s:g} s (break-even rule, device memory contended)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in ("tokens", "KV\n(GB)", "reload\n(ms)", "recompute\n(s)", "held\n(GB·s)", "action"):
        pause.add_column(name, justify="left" if name == "action" else "right", no_wrap=True)
    for pause_row in plan.pauses:
        d = pause_row.decision
        pause.add_row(
            f"{pause_row.context_tokens:,}",
            _gb(pause_row.kv_bytes),
            _ms(d.reload_s),
            f"{d.recompute_s:,.2f}",
            f"{d.held_gb_s:,.0f}",
            d.action.label.lower(),
        )
    console.print(pause)
    for pause_row in plan.pauses:
        console.print(f"{pause_row.context_tokens:,} tokens: {pause_row.decision.reason}")


def _render_pools(plan: Plan, console: Console) -> None:
    """A hybrid model's two pools per device, as the engine and `kvpilot sim` split them."""
    if not plan.pools:
        return
    longest = plan.pools[0].longest_tokens
    pools = Table(
        title=f"Hybrid pools per device (main: full-attention layers, window: sliding-window "
        f"layers; for {plan.num_seqs:,} sequences)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in ("block (tokens)", "main blocks", "main (GB)", "window blocks", "window (GB)"):
        pools.add_column(name, justify="right")
    pools.add_column(f"seqs at {longest:,}", justify="right")
    for row in plan.pools:
        pools.add_row(
            f"{row.block_size}",
            f"{row.main_blocks:,}",
            _gb(row.main_blocks * row.main_block_bytes),
            f"{row.window_blocks:,}",
            _gb(row.window_blocks * row.window_block_bytes),
            f"{row.longest_seqs:,}",
        )
    console.print(pools)


FRAG_COLUMNS = ("alloc. eff. %", "ext. frag. %", "effective eff. %")
FRAG_KEY = (
    "alloc. eff.: allocation efficiency (η_alloc), share of allocated memory that holds tokens",
    "ext. frag.: external fragmentation (Φ_ext), share of free memory in pieces < a {request} "
    "request",
    "effective eff.: effective efficiency (η_effective), share of the whole pool holding tokens",
)


def render_frag(
    reports: list[FragReport],
    workload_title: str,
    scenarios: list[ScenarioResult],
    console: Console,
) -> None:
    gib = 1 << 30
    console.print(workload_title, style="italic")
    table = Table(box=box.SIMPLE_HEAD)
    for name in ("allocator", "admitted", *FRAG_COLUMNS):
        table.add_column(name, justify="left" if name == "allocator" else "right")
    for r in reports:
        table.add_row(
            r.allocator,
            f"{r.admitted:.1f}",
            format_percent(r.eta_alloc),
            format_percent(r.phi_ext),
            format_percent(r.eta_effective),
        )
    console.print(table)
    request = (
        reports[0].request_bytes if reports else (scenarios[0].request_bytes if scenarios else 0)
    )
    for line in FRAG_KEY:
        console.print(f"[dim]{line.format(request=f'{request / gib:g} GiB')}[/]")

    if not scenarios:
        return
    napkin = Table(
        title=f"The spec's pools A and B (Napkin Math 0.2): 10 GiB, 160 KiB/token, next request "
        f"{scenarios[0].request_bytes / gib:g} GiB",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    columns = ("pool", "admitted", *FRAG_COLUMNS[:2], "free GiB", "max hole GiB", "next")
    for name in columns:
        napkin.add_column(name, justify="left" if name == "pool" else "right")
    for sc in scenarios:
        snap = sc.snapshot
        napkin.add_row(
            f"{sc.name}: {sc.allocator}",
            f"{snap.admitted}",
            format_percent(snap.eta_alloc),
            format_percent(snap.phi_ext),
            f"{snap.free_bytes / gib:.2f}",
            f"{max(sc.holes_bytes, default=0) / gib:.2f}",
            "fits" if sc.request_fits else "refused",
        )
    console.print(napkin)
    for sc in scenarios:
        if sc.holes_bytes:
            holes = ", ".join(f"{h >> 20:,}" for h in sc.holes_bytes)
            console.print(f"{sc.name}: free holes of {holes} MiB")
