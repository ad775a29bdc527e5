"""What a fleet simulation measured, per router: hit rate against the ideal, TTFT, imbalance.

``imbalance`` is max over mean of the tokens each replica computed (prefill, recomputation
included, and decode): 1.0 is a perfectly even fleet.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvpilot.fleet.sim import FleetSimulator


@dataclass(frozen=True, slots=True)
class FleetResult:
    router: str
    replicas: int
    duration_s: float
    wall_s: float
    requests: int
    prompt_tokens: int
    cached_tokens: int
    ideal_tokens: int
    ttft_s: np.ndarray
    computed_tokens: dict[str, int]
    rejected: int
    retried: int
    resyncs: int
    counters: dict[str, int] = field(default_factory=dict)
    router_counters: dict[str, int] = field(default_factory=dict)

    @classmethod
    def collect(cls, fleet: FleetSimulator, counters: dict[str, int]) -> FleetResult:
        log = fleet.log
        ttft = np.asarray(log.ttft_s, dtype=float)
        router = fleet.router
        extra = {
            name: int(getattr(router, name))
            for name in ("migrations", "rehomed")
            if hasattr(router, name)
        }
        return cls(
            router=fleet.router_name,
            replicas=len(fleet.replicas),
            duration_s=fleet.duration_s,
            wall_s=fleet.wall_s,
            requests=len(log.ttft_s),
            prompt_tokens=int(sum(log.prompt_tokens)),
            cached_tokens=int(sum(log.cached_tokens)),
            ideal_tokens=int(sum(log.ideal_tokens)),
            ttft_s=ttft[~np.isnan(ttft)],
            computed_tokens=fleet.computed_tokens(),
            rejected=fleet.rejected,
            retried=fleet.retried,
            resyncs=fleet.resyncs,
            counters=dict(counters),
            router_counters=extra,
        )

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ideal_hit_rate(self) -> float:
        return self.ideal_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def imbalance(self) -> float:
        values = np.asarray(list(self.computed_tokens.values()), dtype=float)
        return float(values.max() / values.mean()) if len(values) and values.mean() else 1.0

    def ttft_percentile(self, q: float) -> float:
        return float(np.percentile(self.ttft_s, q)) if len(self.ttft_s) else math.nan

    def summary(self) -> dict[str, Any]:
        return {
            "router": self.router,
            "replicas": self.replicas,
            "duration_s": self.duration_s,
            "wall_s": self.wall_s,
            "requests": self.requests,
            "hit_rate": self.hit_rate,
            "ideal_hit_rate": self.ideal_hit_rate,
            "p50_ttft_s": self.ttft_percentile(50),
            "p99_ttft_s": self.ttft_percentile(99),
            "imbalance": self.imbalance,
            "rejected": self.rejected,
            "retried": self.retried,
            "resyncs": self.resyncs,
            **self.router_counters,
            **self.counters,
        }


def print_fleet_results(console: Console, results: Sequence[FleetResult]) -> None:
    first = results[0]
    table = Table(
        title=f"fleet of {first.replicas} replicas, {first.duration_s:.0f} s simulated "
        f"(ideal hit rate {first.ideal_hit_rate:.1%}: one infinite cache)"
    )
    for col in (
        "router",
        "hit rate",
        "of ideal",
        "TTFT p50",
        "TTFT p99",
        "imbalance",
        "requests",
        "wall",
    ):
        table.add_column(col, justify="left" if col == "router" else "right")
    for r in results:
        table.add_row(
            r.router,
            f"{r.hit_rate:.1%}",
            f"{r.hit_rate / r.ideal_hit_rate:.2f}" if r.ideal_hit_rate else "-",
            f"{r.ttft_percentile(50) * 1e3:,.0f} ms",
            f"{r.ttft_percentile(99) * 1e3:,.0f} ms",
            f"{r.imbalance:.2f}",
            f"{r.requests:,}",
            f"{r.wall_s:.0f} s",
        )
    console.print(table)


def plot_router_comparison(results: Sequence[FleetResult], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.router for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    x = np.arange(len(results))
    axes[0].bar(x, [r.hit_rate for r in results], color="tab:blue")
    axes[0].axhline(results[0].ideal_hit_rate, color="k", ls="--", lw=1, label="ideal")
    axes[0].set_title("prefix hit rate")
    axes[0].legend(loc="lower right")
    width = 0.38
    axes[1].bar(x - width / 2, [r.ttft_percentile(50) for r in results], width, label="p50")
    axes[1].bar(x + width / 2, [r.ttft_percentile(99) for r in results], width, label="p99")
    axes[1].set_yscale("log")
    axes[1].set_title("TTFT (s)")
    axes[1].legend()
    axes[2].bar(x, [r.imbalance for r in results], color="tab:orange")
    axes[2].axhline(1.0, color="k", lw=1)
    axes[2].set_title("imbalance (max / mean tokens computed)")
    for ax in axes:
        ax.set_xticks(x, names, rotation=30, ha="right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
