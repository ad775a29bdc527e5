"""The `kvpilot top` view: KV per tier against tau_high, sessions, hit rates, tiers, pauses.

Built from the latest `Sample` and the one before it: "now" figures are rates over the
interval between them (the first view has no "now" yet).
"""

from __future__ import annotations

import time

from rich import box
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kvpilot.policy.breakeven import PauseAction, action_label
from kvpilot.top.sample import Sample
from kvpilot.units import format_bytes, format_rate, format_seconds

TIERS = ("device", "host", "disk")
DIRECTIONS = ("device_to_host", "host_to_device", "device_to_disk", "disk_to_device")
SESSION_STATES = ("running", "waiting", "paused", "idle")
BAR_WIDTH = 32


def usage_bar(used: float, tau_high: float | None = None, width: int = BAR_WIDTH) -> Text:
    """``████████░░░|░░░`` with ``|`` at tau_high (the admission ceiling)."""
    used = min(max(used, 0.0), 1.0)
    filled = round(used * width)
    mark = None if tau_high is None else min(width - 1, round(tau_high * width))
    over = tau_high is not None and used >= tau_high
    text = Text()
    for i in range(width):
        if i == mark:
            text.append("|", style="bold red" if over else "bold")
        elif i < filled:
            text.append("█", style="red" if over else "green")
        else:
            text.append("░", style="dim")
    return text


def _ratio(num: float, den: float) -> str:
    return f"{num / den:.1%}" if den > 0 else "-"


def _title(text: str) -> Text:
    return Text(text, style="bold")


def render(url: str, current: Sample, previous: Sample | None, max_pauses: int = 6) -> Group:
    """The whole view, at most 100 columns wide."""
    return Group(
        _header(url, current),
        _memory(current),
        _work(current),
        Text(""),
        _hits(current, previous),
        _tiers(current, previous),
        Text(""),
        _pauses(current, max_pauses),
    )


def _header(url: str, s: Sample) -> Text:
    health = s.health
    tiers = health.get("tiers", {})
    engine = health.get("engine", "unknown")
    line = Text(f"kvpilot top · {url} · ", style="bold")
    line.append(f"model {health.get('model', '?')} · policy {tiers.get('policy', '?')} · ")
    line.append(f"engine {engine}", style="green" if engine == "running" else "bold red")
    line.append(f" · {time.strftime('%H:%M:%S')}", style="dim")
    return line


def _memory(s: Sample) -> Table:
    tau = s.value("kvpilot_tau_high_ratio")
    table = Table(
        title=f"KV memory (| marks tau_high {tau:.2f}: new work waits above it)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    for name, justify in (("tier", "left"), ("in use", "left"), ("", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    table.add_column("blocks used / total", justify="right")
    table.add_column("cached", justify="right")
    usage = s.by("kvpilot_kv_usage_ratio", "tier")
    for tier in TIERS:
        total = s.value("kvpilot_kv_blocks", state="total", tier=tier)
        if not total:
            table.add_row(tier, Text("not configured", style="dim"), "", "", "")
            continue
        used = s.value("kvpilot_kv_blocks", state="used", tier=tier)
        cached = s.value("kvpilot_kv_blocks", state="cached", tier=tier)
        ratio = usage.get(tier, used / total)
        table.add_row(
            tier,
            usage_bar(ratio, tau if tier == "device" else None),
            f"{ratio:.0%}",
            f"{used:,.0f} / {total:,.0f}",
            f"{cached:,.0f}",
        )
    _window_row(table, s, tau)
    return table


def _window_row(table: Table, s: Sample, tau: float) -> None:
    """A hybrid model's sliding-window pool: held blocks against tau_high (admission weighs
    the fuller pool), and what releasing blocks outside the window saves."""
    total = s.value("kvpilot_window_kv_blocks", state="total")
    if not total:
        return
    used = s.value("kvpilot_window_kv_blocks", state="used")
    held = s.value("kvpilot_window_kv_blocks", state="held")
    window = s.value("kvpilot_window_tokens")
    saved = s.value("kvpilot_window_kv_saved_bytes")
    ratio = held / total
    table.add_row(
        f"window ({window:,.0f} tok)",
        usage_bar(ratio, tau),
        f"{ratio:.0%}",
        f"{held:,.0f} / {total:,.0f}",
        f"{used - held:,.0f}",
    )
    released = s.value("kvpilot_window_kv_released_blocks")
    note = f"saves {format_bytes(saved)}" if saved else f"{released:,.0f} blocks released"
    table.add_row("", Text(f"{note} vs full attention", style="dim"), "", "", "")


def _work(s: Sample) -> Table:
    table = Table(title="Work", title_justify="left", box=None, show_header=False, padding=(0, 1))
    table.add_column(style="bold")
    table.add_column()
    running, waiting = s.value("kvpilot_requests_running"), s.value("kvpilot_requests_waiting")
    table.add_row("requests", f"running {running:.0f} · waiting {waiting:.0f}")
    states = s.by("kvpilot_sessions", "state")
    sessions = " · ".join(f"{st} {states.get(st, 0):.0f}" for st in SESSION_STATES)
    table.add_row("sessions", f"{sessions} (open {s.value('kvpilot_sessions_open'):.0f})")
    return table


def _hits(s: Sample, prev: Sample | None) -> Table:
    table = Table(
        title="Prefix cache (share of prompt tokens served from cache)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        min_width=60,
    )
    table.add_column("")
    table.add_column("now", justify="right")
    table.add_column("overall", justify="right")
    prompt, cached, ideal = (
        s.value("kvpilot_prompt_tokens_total"),
        s.value("kvpilot_cached_prompt_tokens_total"),
        s.value("kvpilot_ideal_cached_prompt_tokens_total"),
    )
    d_prompt = d_cached = d_ideal = 0.0
    if prev is not None:
        d_prompt = prompt - prev.value("kvpilot_prompt_tokens_total")
        d_cached = cached - prev.value("kvpilot_cached_prompt_tokens_total")
        d_ideal = ideal - prev.value("kvpilot_ideal_cached_prompt_tokens_total")
    table.add_row("hit rate", _ratio(d_cached, d_prompt), _ratio(cached, prompt))
    table.add_row("ideal (unbounded cache)", _ratio(d_ideal, d_prompt), _ratio(ideal, prompt))
    return table


def _tiers(s: Sample, prev: Sample | None) -> Table:
    table = Table(
        title="Pauses and tiers", title_justify="left", box=None, show_header=False, padding=(0, 1)
    )
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    hits, stalls = s.value("kvpilot_prefetch_hits_total"), s.value("kvpilot_prefetch_stalls_total")
    table.add_row(
        "prefetch",
        f"hits {hits:,.0f} · stalls {stalls:,.0f} "
        "[dim](a stall: a resumed turn waited for its KV to load)[/]",
    )
    moved = s.by("kvpilot_kv_bytes_moved_total", "direction")
    elapsed = s.at - prev.at if prev is not None else 0.0
    before = prev.by("kvpilot_kv_bytes_moved_total", "direction") if prev is not None else {}
    parts = []
    for d in DIRECTIONS:
        rate = (moved.get(d, 0.0) - before.get(d, 0.0)) / elapsed if elapsed > 0 else 0.0
        now = f" ({format_rate(rate)})" if rate > 0 else ""
        parts.append(f"{d.replace('_to_', '→')} {format_bytes(moved.get(d, 0.0))}{now}")
    table.add_row("KV moved", " · ".join(parts))
    decisions = s.by("kvpilot_pause_decisions_total", "action")
    made = [(a, n) for a, n in decisions.items() if n and a != "demoted"]
    text = " · ".join(f"{action_label(a)} {n:,.0f}" for a, n in sorted(made, key=lambda x: -x[1]))
    table.add_row("pauses", text or "none yet")
    table.add_row(
        "demoted",
        f"{decisions.get('demoted', 0):,.0f} [dim](idle KV moved out to make room)[/] · "
        f"recomputed {s.value('kvpilot_recomputed_tokens_total'):,.0f} tokens",
    )
    return table


def _pauses(s: Sample, limit: int) -> Table:
    table = Table(
        title="Last pause decisions (one per session, newest first)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    table.add_column("ago", justify="right", no_wrap=True)
    table.add_column("session", no_wrap=True)
    table.add_column("tool · wait", no_wrap=True)
    table.add_column("decision and why", overflow="fold")
    pauses = [x for x in s.sessions if x.get("last_pause")]
    pauses.sort(key=lambda x: -float(x["last_pause"].get("decided_at") or 0.0))
    now = time.time()
    for x in pauses[:limit]:
        p = x["last_pause"]
        decided = p.get("decided_at")
        ago = format_seconds(max(0.0, now - decided)) if decided else "-"
        wait = p.get("expected_wait_s")
        tool = f"{p.get('tool') or '-'} · {format_seconds(wait) if wait is not None else '-'}"
        state = " [dim](now paused)[/]" if x.get("state") == "paused" else ""
        table.add_row(ago, escape(str(x["id"])[-12:]), escape(tool), _reason(p) + state)
    if not pauses:
        table.add_row("", "", "", Text("no pauses yet", style="dim"))
    return table


def _reason(pause: dict[str, object]) -> str:
    reason = escape(str(pause.get("reason") or ""))
    try:
        label = PauseAction(str(pause.get("action"))).label
    except ValueError:
        return reason
    if reason.startswith(label):
        return f"[bold]{label}[/]{reason[len(label) :]}"
    return f"[bold]{label}[/] {reason}"


def render_error(url: str, message: str) -> RenderableType:
    return Text(f"kvpilot top · {url} · {message} (retrying)", style="bold red")
