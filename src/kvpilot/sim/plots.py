"""PNG figures of a simulation and of the sizing math (matplotlib, no display needed).

* ``kv_usage.png``: U_KV over time with the admission ceiling and the physical wall, and
  the trajectories running, waiting and holding KV (the shape of the spec's Figure 13);
* ``latency.png``: p50/p99 TTFT and ITL over time, and against KV usage (Figure 12);
* ``policies.png``: the policy comparison;
* ``breakeven.png``: resume latency against pause duration for retain / offload /
  recompute, and the decision regimes over context length and wait (Figure 10);
* ``capacity.png``: trajectories a node holds by context length, cold and shared (Table 7):
  the figures of `kvpilot plan` (drawn from `make_plan` results), its assumptions in the
  title;
* `plot_trace_diagnosis`: the figure of ``kvpilot trace analyze --plot``.

Figures are drawn on `matplotlib.figure.Figure` objects, never through pyplot, so nothing
touches a display or global state.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from kvpilot.policy.breakeven import PauseAction, decide_pause
from kvpilot.sim.report import SimResult
from kvpilot.sizing.geometry import ModelGeometry
from kvpilot.sizing.hardware import Node
from kvpilot.sizing.plan import Plan
from kvpilot.sizing.plan import pause_inputs as plan_pause_inputs
from kvpilot.trace.analyze import TraceDiagnosis

_ACTION_ORDER = (
    PauseAction.RETAIN,
    PauseAction.OFFLOAD_HOST,
    PauseAction.OFFLOAD_DISK,
    PauseAction.DROP,
)
_ACTION_COLORS = ("#4c9f70", "#4a7fc1", "#8e6bbf", "#d0664f")
# One colour per latency metric, in every panel: TTFT blue, ITL orange; p99 dashed.
_LATENCY_STYLE = {
    "ttft_p50_s": ("TTFT p50", "#1f77b4", "-"),
    "ttft_p99_s": ("TTFT p99", "#1f77b4", "--"),
    "itl_p50_s": ("ITL p50", "#ff7f0e", "-"),
    "itl_p99_s": ("ITL p99", "#ff7f0e", "--"),
}
# Capacity bars: per node, cold then shared, from these pairs.
_CAPACITY_COLORS = (("#9ecae1", "#3182bd"), ("#fdae6b", "#e6550d"), ("#a1d99b", "#31a354"))


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_kv_usage(result: SimResult, path: Path, tau_high: float | None = None) -> Path:
    s = result.samples
    t = s["time_s"] / 60.0
    fig = Figure(figsize=(9, 6))
    ax, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax.plot(t, 100 * s["kv_usage"], label="U_KV (allocated blocks)", color="#c0392b")
    ax.plot(t, 100 * s["kv_held"], label="held (not evictable)", color="#2c3e50", lw=1)
    if tau_high is not None:
        ax.axhline(100 * tau_high, ls="--", color="#e67e22", label=f"tau_high = {tau_high:g}")
    ax.axhline(100, ls=":", color="black", label="physical wall")
    ax.set_ylabel("KV pool occupancy (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"KV usage over time: {result.label} ({result.model}, {result.node})")
    ax.legend(loc="lower right", fontsize=8)
    ax2.plot(t, s["running"], label="running", lw=1)
    ax2.plot(t, s["waiting"], label="waiting", lw=1)
    ax2.plot(t, s["resident"], label="holding KV", lw=1)
    ax2.set_xlabel("time (min)")
    ax2.set_ylabel("trajectories")
    ax2.legend(loc="upper left", fontsize=8)
    return _save(fig, path)


def plot_latency(result: SimResult, path: Path) -> Path:
    """``latency.png``: `latency_figure` saved to ``path``."""
    return _save(latency_figure(result), path)


def latency_figure(result: SimResult) -> Figure:
    """Latency percentiles over time (left) and against KV occupancy (right), each metric in
    the same colour in both panels."""
    s = result.samples
    t = s["time_s"] / 60.0
    fig = Figure(figsize=(11, 4.5))
    left, right = fig.subplots(1, 2)
    for key, (label, color, style) in _LATENCY_STYLE.items():
        ms = 1e3 * s[key]
        ok = np.isfinite(ms)
        left.plot(t[ok], ms[ok], style, color=color, label=label, lw=1)
    left.set_yscale("log")
    left.set_xlabel("time (min)")
    left.set_ylabel("latency (ms)")
    left.set_title("latency percentiles over time")
    left.legend(fontsize=8)

    usage = s["kv_usage"]
    edges = np.linspace(0.0, 1.0, 21)
    centers = (edges[:-1] + edges[1:]) / 2
    for key, (label, color, style) in _LATENCY_STYLE.items():
        reduce = np.nanmedian if key.endswith("p50_s") else np.nanmax
        values = s[key]
        ys = []
        for lo, hi in itertools.pairwise(edges):
            sel = values[(usage >= lo) & (usage < hi) & np.isfinite(values)]
            ys.append(1e3 * float(reduce(sel)) if len(sel) else math.nan)
        y = np.asarray(ys)
        ok = np.isfinite(y)
        marker = "o" if key.startswith("itl") else "s"
        right.plot(
            100 * centers[ok], y[ok], style, marker=marker, color=color, label=label, ms=3, lw=1
        )
    right.set_yscale("log")
    right.set_xlabel("KV pool occupancy U_KV (%)")
    right.set_ylabel("latency (ms)")
    right.set_title("latency against KV occupancy")
    right.legend(fontsize=8)
    return fig


def plot_policy_comparison(results: Sequence[SimResult], path: Path) -> Path:
    labels = [r.label for r in results]
    summaries = [r.summary() for r in results]
    panels = (
        ("output tokens/s", [s["output_tokens_per_s"] for s in summaries]),
        ("TTFT p99 (s)", [s["ttft_p99_s"] for s in summaries]),
        ("prefix hit rate (%)", [100 * r.hit_rate for r in results]),
        ("GB moved between tiers", [r.bytes_moved / 1e9 for r in results]),
        (
            "tokens computed again",
            [r.recomputed_tokens + r.extra.get("engine_recomputed_tokens", 0) for r in results],
        ),
    )
    fig = Figure(figsize=(15, 3.6))
    axes = fig.subplots(1, len(panels))
    x = np.arange(len(labels))
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(x, [0 if math.isnan(v) else v for v in values], color="#4a7fc1")
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    return _save(fig, path)


def plot_breakeven(
    geometry: ModelGeometry,
    node: Node,
    tp: int,
    path: Path,
    context_tokens: int = 16384,
    mfu: float = 0.45,
) -> Path:
    """Resume latency vs pause for one context (left) and the decision regimes (right)."""
    waits = np.logspace(-2, math.log10(3600), 200)
    base = plan_pause_inputs(geometry, node, tp, context_tokens, 1.0, mfu)
    decision = decide_pause(base)
    reload_s, recompute_s = decision.reload_s, decision.recompute_s
    offload = np.where(waits >= reload_s, reload_s, reload_s + (reload_s - waits))
    fig = Figure(figsize=(12, 4.8))
    left, right = fig.subplots(1, 2)
    left.plot(waits, np.zeros_like(waits) + 1e-3, label="retain: 0 s (drawn at 1 ms); holds HBM")
    left.plot(waits, offload, label="offload to host + reload")
    left.plot(waits, np.full_like(waits, recompute_s), label="drop + recompute")
    round_trip = decision.round_trip_s
    left.axvline(round_trip, ls=":", color="gray", label=f"round trip {round_trip * 1e3:.0f} ms")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("tool pause (s)")
    left.set_ylabel("resume latency (s)")
    gib = geometry.kv_bytes(context_tokens, tp) * tp / 2**30
    left.set_title(f"{geometry.name}, S = {context_tokens:,} tokens ({gib:.1f} GiB)")
    held = left.twinx()
    held.plot(waits, gib * 2**30 / 1e9 * waits, color="#4c9f70", ls="--", lw=1)
    held.set_yscale("log")
    held.set_ylabel("retain: HBM held (GB·s)", color="#4c9f70")
    left.legend(fontsize=8, loc="center left")

    contexts = np.logspace(math.log10(1024), math.log10(131072), 40).astype(int)
    grid_waits = np.logspace(-2, math.log10(3600), 60)
    codes = np.zeros((len(contexts), len(grid_waits)))
    for i, ctx in enumerate(contexts):
        for j, w in enumerate(grid_waits):
            d = decide_pause(plan_pause_inputs(geometry, node, tp, int(ctx), float(w), mfu))
            codes[i, j] = _ACTION_ORDER.index(d.action)
    cmap = ListedColormap(_ACTION_COLORS)
    right.pcolormesh(grid_waits, contexts, codes, cmap=cmap, vmin=-0.5, vmax=3.5, shading="auto")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("expected tool wait (s)")
    right.set_ylabel("trajectory context (tokens)")
    right.set_title(f"pause decision, {node.name} (device pressure 1.0)")
    for action, color in zip(_ACTION_ORDER, _ACTION_COLORS, strict=True):
        right.scatter([], [], color=color, marker="s", label=action.value)
    right.legend(fontsize=8, loc="lower left")
    return _save(fig, path)


def plot_capacity(
    plans: Sequence[Plan], path: Path, observed: dict[str, float] | None = None
) -> Path:
    """``capacity.png``: `capacity_figure` saved to ``path``."""
    return _save(capacity_figure(plans, observed), path)


def capacity_figure(plans: Sequence[Plan], observed: dict[str, float] | None = None) -> Figure:
    """Trajectories per node by context length, cold (eq. 6) and sharing a prefix (eq. 7):
    the rows of ``plans`` (one per node, from `make_plan`), so the bars are the figures
    `kvpilot plan` prints. The title states the plan's assumptions.

    ``observed`` adds horizontal marks (e.g. the peak trajectories holding KV in a run).
    """
    if not plans:
        raise ValueError("plot_capacity needs at least one plan")
    first = plans[0]
    contexts = [row.context_tokens for row in first.capacity]
    fig = Figure(figsize=(9, 4.8))
    ax = fig.subplots()
    width = 0.8 / (2 * len(plans))
    x = np.arange(len(contexts))
    for k, plan in enumerate(plans):
        b = plan.budget
        layout = f"{plan.node} TP {b.tp}" + (f" x {b.replicas}" if b.replicas > 1 else "")
        cold_color, shared_color = _CAPACITY_COLORS[k % len(_CAPACITY_COLORS)]
        off = (2 * k - len(plans)) * width + width / 2
        bars = ax.bar(
            x + off,
            [r.cold for r in plan.capacity],
            width,
            color=cold_color,
            label=f"{layout} cold",
        )
        ax.bar_label(bars, fontsize=7)
        bars = ax.bar(
            x + off + width,
            [r.shared or 0 for r in plan.capacity],
            width,
            color=shared_color,
            label=f"{layout} shared {plan.shared_tokens:,} tokens",
        )
        ax.bar_label(bars, fontsize=7)
    for label, value in (observed or {}).items():
        ax.axhline(value, ls="--", lw=1, color="black")
        ax.annotate(label, (len(contexts) - 0.5, value), fontsize=8, ha="right", va="bottom")
    ax.set_xticks(x, [f"{c:,}" for c in contexts])
    ax.set_xlabel("context per trajectory (tokens)")
    ax.set_ylabel("concurrent trajectories per node")
    ax.set_yscale("log")
    reserve = first.budget.reserve_bytes_per_device / 1e9
    ax.set_title(
        f"capacity (kvpilot plan): {first.model}, weights {first.weight_dtype}, KV "
        f"{first.kv_dtype}\noutput {first.output_tokens:,} tokens, headroom "
        f"{first.headroom:.0%}, reserve {reserve:g} GB per device",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    return fig


def plot_trace_diagnosis(d: TraceDiagnosis, path: Path) -> Path:
    """Per-session reuse vs ideal, the tool-wait distribution, and where calls diverge."""
    fig = Figure(figsize=(13, 4.2))
    a, b, c = fig.subplots(1, 3)
    x = np.arange(len(d.sessions))
    a.bar(x - 0.2, [100 * s.reuse_rate for s in d.sessions], 0.4, label="reuse of previous call")
    a.bar(x + 0.2, [100 * s.ideal_rate for s in d.sessions], 0.4, label="ideal (infinite cache)")
    a.set_xlabel("session")
    a.set_ylabel("prefix hit (%)")
    a.set_title("prefix hit per session")
    a.set_ylim(0, 115)
    a.legend(fontsize=8, loc="upper right", ncols=2)
    gaps = [g for s in d.sessions for g in s.gaps_s if g > 0]
    if gaps:
        bins = np.logspace(math.log10(min(gaps)), math.log10(max(gaps)) + 1e-9, 30)
        b.hist(gaps, bins=bins, color="#4a7fc1")
        b.set_xscale("log")
    b.set_xlabel("gap between calls (s)")
    b.set_ylabel("calls")
    b.set_title("tool wait distribution")
    for k, s in enumerate(d.sessions):
        points = [
            (call.index, call.divergence / s.calls[call.index - 1].prompt_tokens)
            for call in s.calls
            if call.divergence is not None and s.calls[call.index - 1].prompt_tokens
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            c.plot(xs, np.minimum(ys, 1.0), ".", ms=4, color=f"C{k % 10}")
    c.axhline(1.0, ls=":", color="gray")
    c.set_ylim(-0.05, 1.1)
    c.set_xlabel("call index in session")
    c.set_ylabel("first divergence / previous length")
    c.set_title("where each call diverges (1 = appended)")
    return _save(fig, path)
