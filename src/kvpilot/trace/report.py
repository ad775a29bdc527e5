"""The trace diagnosis as rich tables: the top sessions, the causes of breaks with counts,
the top breaking calls, sessions that mix conversations; optionally every call."""

from __future__ import annotations

import re

from rich.console import Console
from rich.table import Table

from kvpilot.trace.analyze import DEFAULT_TOP, UNKNOWN, CallDiagnosis, TraceDiagnosis

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def short_id(session_id: str, width: int = 12) -> str:
    s = _SAFE.sub("_", session_id)
    return s if len(s) <= width else s[: width - 1] + "…"


def render_diagnosis(
    console: Console, d: TraceDiagnosis, turns: bool = False, top: int = DEFAULT_TOP
) -> None:
    """The diagnosis as rich tables: the top sessions, the causes of breaks with counts, the
    top breaking calls, sessions that mix conversations; optionally every call."""
    _render_sessions(console, d, top)
    g = d.gaps
    console.print(
        f"tool wait (gap between calls): n={g.count}, p50 {g.p50_s:.2f} s, p90 {g.p90_s:.2f} s, "
        f"p99 {g.p99_s:.2f} s, max {g.max_s:.2f} s"
    )
    zones = ", ".join(f"{k}: {v}" for k, v in sorted(d.zones.items(), key=lambda kv: -kv[1]))
    console.print(f"where consecutive calls first differ: {zones or '-'}")
    _render_interleaved(console, d, top)
    _render_breaks(console, d, top)
    if turns:
        tt = Table(title="calls", title_justify="left")
        for col in ("session", "call", "conv", "tokens", "reuse", "ideal", "diverges at", "cause"):
            tt.add_column(col)
        for s in d.sessions:
            for c in s.calls:
                tt.add_row(
                    short_id(s.session_id),
                    str(c.index),
                    str(c.conversation),
                    f"{c.prompt_tokens:,}",
                    f"{c.reuse_tokens:,}",
                    f"{c.ideal_tokens:,}",
                    "-" if c.divergence is None else f"{c.divergence:,}",
                    c.cause or c.divergence_zone or "-",
                )
        console.print(tt)


def _more(console: Console, shown: int, total: int, what: str) -> None:
    if total > shown:
        console.print(f"  ... and {total - shown:,} more {what} (--top N shows more, --json all)")


def _render_sessions(console: Console, d: TraceDiagnosis, top: int) -> None:
    ranked = sorted(d.sessions, key=lambda s: (-s.lost_tokens, -s.prompt_tokens))[:top]
    title = f"prefix reuse per session (block {d.block_size}; top {len(ranked)} by lost tokens)"
    table = Table(title=title, title_justify="left")
    for col in ("session", "calls", "conv", "prompt tok", "reuse", "ideal", "breaks", "lost tok"):
        table.add_column(col, justify="left" if col == "session" else "right")
    for s in ranked:
        table.add_row(
            short_id(s.session_id),
            str(len(s.calls)),
            str(max(1, len(s.conversations))),
            f"{s.prompt_tokens:,}",
            f"{s.reuse_rate:.1%}",
            f"{s.ideal_rate:.1%}",
            str(len(s.breaks)),
            f"{s.lost_tokens:,}",
        )
    table.add_row(
        f"all {len(d.sessions):,}",
        f"{sum(len(s.calls) for s in d.sessions):,}",
        f"{sum(max(1, len(s.conversations)) for s in d.sessions):,}",
        f"{d.prompt_tokens:,}",
        f"{d.reuse_rate:.1%}",
        f"{d.ideal_rate:.1%}",
        f"{sum(len(s.breaks) for s in d.sessions):,}",
        f"{sum(s.lost_tokens for s in d.sessions):,}",
        style="bold",
    )
    console.print(table)
    _more(console, len(ranked), len(d.sessions), "sessions")


def _render_interleaved(console: Console, d: TraceDiagnosis, top: int) -> None:
    mixed = d.interleaved_sessions
    if not mixed:
        return
    console.print(
        f"{len(mixed):,} session(s) mix several conversations (an orchestrator and its "
        "sub-agents, or a user simulator and an agent, under one session id); their reuse "
        "is counted per conversation, and switches between them are not breaks:"
    )
    table = Table(title_justify="left")
    for col in ("session", "conversations", "calls per conversation", "reuse per conversation"):
        table.add_column(col)
    ranked = sorted(mixed, key=lambda s: -len(s.conversations))[:top]
    for s in ranked:
        convs = s.conversations[:6]
        tail = " ..." if len(s.conversations) > 6 else ""
        table.add_row(
            short_id(s.session_id),
            str(len(s.conversations)),
            " ".join(str(c.calls) for c in convs) + tail,
            " ".join(f"{c.reuse_rate:.0%}" for c in convs) + tail,
        )
    console.print(table)
    _more(console, len(ranked), len(mixed), "mixed sessions")


def _render_breaks(console: Console, d: TraceDiagnosis, top: int) -> None:
    breaks = [(s, c) for s in d.sessions for c in s.breaks]
    if not breaks:
        console.print("no conversation breaks its prefix: every call extends the one before")
        return
    by_cause: dict[str, list[CallDiagnosis]] = {}
    for _, c in breaks:
        by_cause.setdefault(c.cause or UNKNOWN, []).append(c)
    ct = Table(title="why prefixes break (by cause)", title_justify="left")
    for col in ("cause", "calls", "sessions", "lost tok", "example"):
        ct.add_column(col)
    for cause, cs in sorted(by_cause.items(), key=lambda kv: -sum(c.lost_tokens for c in kv[1])):
        ct.add_row(
            cause,
            f"{len(cs):,}",
            f"{len({c.session_id for c in cs}):,}",
            f"{sum(c.lost_tokens for c in cs):,}",
            (cs[0].detail or "")[:60],
        )
    console.print(ct)
    ranked = sorted(breaks, key=lambda sc: -sc[1].lost_tokens)[:top]
    bt = Table(title=f"top {len(ranked)} breaking calls (by lost tokens)", title_justify="left")
    for col in ("session", "call", "diverges at", "zone", "cause", "lost tok"):
        bt.add_column(col)
    for s, c in ranked:
        bt.add_row(
            short_id(s.session_id),
            str(c.index),
            f"{c.divergence:,}" if c.divergence is not None else "-",
            c.divergence_zone or "-",
            c.cause or "-",
            f"{c.lost_tokens:,}",
        )
    console.print(bt)
    _more(console, len(ranked), len(breaks), "breaking calls")
