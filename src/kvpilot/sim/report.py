"""What a simulation measured, as figures, a JSON summary and rich tables."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

from kvpilot.engine.engine import Engine
from kvpilot.engine.snapshot import EngineSnapshot
from kvpilot.memory.tiers import Tier
from kvpilot.sim.runner import SimulatedRunner
from kvpilot.sim.simulator import Simulator
from kvpilot.units import format_bytes, format_count, format_seconds

_t, _si = format_seconds, format_count  # short names for the long table rows

_SPARK = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True, slots=True)
class SimResult:
    """One run: what was simulated, and everything it measured."""

    label: str
    model: str
    node: str
    tp: int
    replicas: int
    kv_blocks: int
    block_size: int
    cost_model: str
    duration_s: float
    wall_s: float
    steps: int
    busy_s: float
    generated_tokens: int
    prefill_tokens: int
    decode_tokens: int
    prompt_tokens: int
    cached_tokens: int
    radix_hit_rate: float
    preemptions: int
    recomputed_tokens: int
    bytes_moved: int
    fork_copied_blocks: int
    turns_completed: int
    rejected: int
    stalled: bool
    blocked_s: float
    counters: dict[str, int]
    ttft_s: np.ndarray
    itl_s: np.ndarray
    samples: dict[str, np.ndarray]
    note: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    @classmethod
    def collect(
        cls,
        label: str,
        sim: Simulator,
        counters: dict[str, int],
        *,
        model: str,
        node: str,
        tp: int,
        replicas: int,
        cost_model: str,
        note: str | None = None,
        warnings: tuple[str, ...] = (),
    ) -> SimResult:
        engine: Engine = sim.engine
        runner = engine.executor
        snap = engine.snapshot()
        if isinstance(runner, SimulatedRunner):
            recomputed, busy = runner.recomputed_tokens, runner.busy_s
        else:
            recomputed, busy = 0, snap.step_time_s
        return cls(
            label=label,
            model=model,
            node=node,
            tp=tp,
            replicas=replicas,
            kv_blocks=snap.tiers[Tier.DEVICE.value].num_blocks,
            block_size=snap.layout.block_size,
            cost_model=cost_model,
            duration_s=min(sim.now, sim.duration_s),
            wall_s=sim.wall_s,
            steps=snap.steps,
            busy_s=busy,
            generated_tokens=snap.generated_tokens,
            prefill_tokens=snap.prefill_tokens,
            decode_tokens=snap.decode_tokens,
            prompt_tokens=snap.prompt_tokens,
            cached_tokens=snap.cached_prompt_tokens,
            radix_hit_rate=snap.prefix_hit_rate,
            preemptions=snap.preemptions,
            recomputed_tokens=recomputed,
            bytes_moved=snap.total_bytes_moved,
            fork_copied_blocks=snap.fork_copied_blocks,
            turns_completed=len(sim.turns),
            rejected=sim.rejected,
            stalled=sim.stalled,
            blocked_s=sim.blocked_s,
            counters=dict(counters),
            ttft_s=sim.turns.ttft_s(),
            itl_s=np.asarray(sim.itl_s, dtype=float),
            samples=sim.samples.as_arrays(),
            note=note,
            extra=tier_figures(snap),
            warnings=warnings,
        )

    # -- derived figures -----------------------------------------------------------------

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.generated_tokens / self.duration_s if self.duration_s else 0.0

    @property
    def processed_tokens_per_s(self) -> float:
        """Tokens whose KV was computed (prefill and decode) per second."""
        total = self.prefill_tokens + self.decode_tokens
        return total / self.duration_s if self.duration_s else 0.0

    @property
    def trajectories_per_hour(self) -> float:
        done = self.counters.get("trajectories_completed", 0)
        return done * 3600.0 / self.duration_s if self.duration_s else 0.0

    @property
    def sim_s_per_wall_s(self) -> float:
        return self.duration_s / self.wall_s if self.wall_s else math.inf

    def percentiles(self, values: np.ndarray) -> tuple[float, float]:
        if not len(values):
            return math.nan, math.nan
        p50, p99 = np.percentile(values, [50, 99])
        return float(p50), float(p99)

    def summary(self) -> dict[str, Any]:
        ttft50, ttft99 = self.percentiles(self.ttft_s)
        itl50, itl99 = self.percentiles(self.itl_s)
        usage = self.samples.get("kv_usage", np.zeros(0))
        held = self.samples.get("kv_held", np.zeros(0))
        return {
            "label": self.label,
            "model": self.model,
            "node": self.node,
            "tp": self.tp,
            "replicas": self.replicas,
            "kv_blocks": self.kv_blocks,
            "block_size": self.block_size,
            "cost_model": self.cost_model,
            "note": self.note,
            "warnings": list(self.warnings),
            "duration_s": self.duration_s,
            "wall_s": self.wall_s,
            "sim_s_per_wall_s": self.sim_s_per_wall_s,
            "steps": self.steps,
            "busy_fraction": self.busy_s / self.duration_s if self.duration_s else 0.0,
            "output_tokens_per_s": self.output_tokens_per_s,
            "processed_tokens_per_s": self.processed_tokens_per_s,
            "node_output_tokens_per_s": self.output_tokens_per_s * self.replicas,
            "trajectories_per_hour": self.trajectories_per_hour,
            "turns_completed": self.turns_completed,
            "ttft_p50_s": ttft50,
            "ttft_p99_s": ttft99,
            "itl_p50_s": itl50,
            "itl_p99_s": itl99,
            "kv_usage_mean": float(usage.mean()) if len(usage) else 0.0,
            "kv_usage_max": float(usage.max()) if len(usage) else 0.0,
            "kv_held_mean": float(held.mean()) if len(held) else 0.0,
            "kv_held_max": float(held.max()) if len(held) else 0.0,
            "hit_rate": self.hit_rate,
            "radix_hit_rate": self.radix_hit_rate,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "prefill_tokens": self.prefill_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "preemptions": self.preemptions,
            "bytes_moved": self.bytes_moved,
            "fork_copied_blocks": self.fork_copied_blocks,
            "rejected": self.rejected,
            "stalled": self.stalled,
            "blocked_s": self.blocked_s,
            **self.counters,
            **self.extra,
        }


def tier_figures(snap: EngineSnapshot) -> dict[str, Any]:
    """Pause decisions and tier telemetry of the engine's offload manager."""
    return {
        "pause_decisions": dict(snap.pause_decisions),
        "bytes_moved_by_direction": dict(snap.bytes_moved),
        "engine_recomputed_tokens": snap.recomputed_tokens,
        "prefetch_hits": snap.prefetch_hits,
        "prefetch_stalls": snap.prefetch_stalls,
        "idle_gb_s": snap.idle_gb_s,
        "reload_p50_s": snap.reload_p50_s,
        "host_blocks": snap.tiers[Tier.HOST.value].num_blocks,
    }


def sparkline(values: Sequence[float] | np.ndarray, width: int = 48, top: float = 1.0) -> str:
    """Values in [0, top] as a row of block characters, averaged into ``width`` cells."""
    a = np.asarray(values, dtype=float)
    if not len(a):
        return ""
    cells = np.array_split(a, min(width, len(a)))
    out = []
    for c in cells:
        v = float(np.nanmean(c)) if np.isfinite(c).any() else 0.0
        k = round(min(max(v / top, 0.0), 1.0) * (len(_SPARK) - 1)) if top > 0 else 0
        out.append(_SPARK[k])
    return "".join(out)


def print_result(console: Console, r: SimResult) -> None:
    s = r.summary()
    table = Table(title=f"kvpilot sim: {r.label}", show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value")
    rows = [
        (
            "model / node",
            f"{r.model} on {r.node} (TP={r.tp}, {r.replicas} replica(s) simulated as 1)",
        ),
        ("KV pool", f"{r.kv_blocks:,} blocks x {r.block_size} tokens"),
        ("cost model", r.cost_model),
        (
            "simulated",
            f"{r.duration_s:,.0f} s in {r.wall_s:.1f} s wall ({s['sim_s_per_wall_s']:.0f}x)",
        ),
        (
            "throughput",
            f"{s['output_tokens_per_s']:,.0f} output tok/s, "
            f"{s['processed_tokens_per_s']:,.0f} processed tok/s (per replica)",
        ),
        (
            "trajectories / hour",
            f"{s['trajectories_per_hour']:,.1f} "
            f"({r.counters.get('trajectories_completed', 0)} done, "
            f"{r.counters.get('trajectories_started', 0)} started)",
        ),
        ("TTFT p50 / p99", f"{_t(s['ttft_p50_s'])} / {_t(s['ttft_p99_s'])}"),
        ("ITL p50 / p99", f"{_t(s['itl_p50_s'])} / {_t(s['itl_p99_s'])}"),
        (
            "KV usage",
            f"mean {s['kv_usage_mean']:.0%}, max {s['kv_usage_max']:.0%}; held (not "
            f"evictable) mean {s['kv_held_mean']:.0%}, max {s['kv_held_max']:.0%}",
        ),
        ("KV usage over time", sparkline(r.samples.get("kv_usage", []))),
        ("prefix hit rate", f"{r.hit_rate:.1%} (radix {r.radix_hit_rate:.1%})"),
        (
            "recomputed tokens",
            f"{format_count(r.recomputed_tokens)} by {r.preemptions:,} preemptions; "
            f"{_si(r.extra.get('engine_recomputed_tokens', 0))} computed again after their KV "
            f"was dropped or evicted",
        ),
        (
            "bytes moved",
            f"{format_bytes(r.bytes_moved)} between tiers (host tier "
            f"{r.extra.get('host_blocks', 0):,} blocks); {r.fork_copied_blocks:,} fork tail "
            "blocks copied",
        ),
        (
            "pause decisions",
            ", ".join(f"{k} {v:,}" for k, v in sorted(r.extra.get("pause_decisions", {}).items()))
            or "none",
        ),
        (
            "turns",
            f"{r.turns_completed:,} finished, {r.rejected:,} rejected"
            + (" — STALLED: waiting work could never be admitted" if r.stalled else ""),
        ),
    ]
    if r.blocked_s > 0:
        rows.append(
            (
                "[red]engine blocked[/red]",
                f"[red]{r.blocked_s:,.0f} s with work waiting and nothing admitted "
                f"(held KV >= tau_high, nothing running)[/red]",
            )
        )
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    if r.note:
        console.print(f"[yellow]note:[/yellow] {r.note}")
    for warning in r.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")


def print_comparison(console: Console, results: Sequence[SimResult]) -> None:
    # Two-line headers, one space between columns, no vertical rules: eleven columns fit
    # a 100-column terminal (about 85 wide with the longest policy names).
    table = Table(
        title="policy comparison (same workload, same seed)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
    )
    columns = (
        "policy",
        "output\ntok/s",
        "traj.\nper h",
        "TTFT\np50",
        "TTFT\np99",
        "ITL\np99",
        "hit\nrate",
        "KV held\n(mean)",
        "KV\nmoved",
        "recomp.\ntokens",
        "engine\nblocked",
    )
    for col in columns:
        if col == "policy":
            table.add_column(col, no_wrap=True)
        else:
            table.add_column(col, justify="right", no_wrap=True)
    for r in results:
        s = r.summary()
        recomputed = r.recomputed_tokens + int(r.extra.get("engine_recomputed_tokens", 0))
        table.add_row(
            r.label,
            f"{s['output_tokens_per_s']:,.0f}",
            f"{s['trajectories_per_hour']:,.1f}",
            format_seconds(s["ttft_p50_s"]),
            format_seconds(s["ttft_p99_s"]),
            format_seconds(s["itl_p99_s"]),
            f"{r.hit_rate:.1%}",
            f"{s['kv_held_mean']:.0%}",
            format_bytes(r.bytes_moved),
            format_count(recomputed),
            f"{r.blocked_s:,.0f} s" + (" stall" if r.stalled else ""),
        )
    console.print(table)
    for r in results:
        if r.note:
            console.print(f"[yellow]note ({r.label}):[/yellow] {r.note}")
