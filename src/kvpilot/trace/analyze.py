"""Diagnose a trace's cacheability: per session and turn, what reuse it got and what broke it.

For call i of a session (calls in timestamp order):

* ``reuse_tokens``: the block-aligned common prefix with call i-1 of the same session (what
  a cache holding only that session's last call would serve);
* ``ideal_tokens``: the hit of an infinite cache holding every earlier call of every session
  (`kvpilot.trace.ideal`);
* ``divergence``: the first token where call i differs from call i-1, and the zone of the
  prompt it falls in (``system``, ``tools``, ``task``, ``history``; past the end of call i-1
  the call only appended, which is what a cache-friendly layout does);
* ``gap_s``: the time since call i-1 (generation plus the tool wait).

A call *breaks the layout* when it diverges more than one block before the end of the
previous call; a session with such calls recomputes what an append-only layout would reuse.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvpilot.errors import ConfigError
from kvpilot.trace.ideal import ideal_hits
from kvpilot.trace.schema import TraceInput

APPENDED = "appended"
UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class ZoneMarker:
    """A zone starts at the first occurrence of ``marker`` (after it when ``after``)."""

    zone: str
    marker: str
    after: bool = False


# miniswe prompts: the task (<pr_description>), the agent instructions (the system part),
# then the history of observations. Chat-template markers cover ChatML and Llama 3 prompts.
DEFAULT_ZONES: tuple[ZoneMarker, ...] = (
    ZoneMarker("task", "<pr_description>"),
    ZoneMarker("system", "<instructions>"),
    ZoneMarker("history", "</instructions>", after=True),
    ZoneMarker("system", "<|im_start|>system"),
    ZoneMarker("tools", "<tools>"),
    ZoneMarker("task", "<|im_start|>user"),
    ZoneMarker("history", "<|im_start|>assistant"),
    ZoneMarker("system", "<|start_header_id|>system<|end_header_id|>"),
    ZoneMarker("task", "<|start_header_id|>user<|end_header_id|>"),
    ZoneMarker("history", "<|start_header_id|>assistant<|end_header_id|>"),
)


def load_zone_markers(path: Path | str) -> tuple[ZoneMarker, ...]:
    """Zone markers from JSON: ``[{"zone": "system", "marker": "<sys>", "after": false}, ...]``."""
    import json

    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read zone markers {p}: {exc}") from exc
    if not isinstance(data, list):
        raise ConfigError(f"{p}: zone markers are a JSON list of {{zone, marker, after}}")
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or not {"zone", "marker"} <= set(item):
            raise ConfigError(f"{p}[{i}]: each zone marker needs 'zone' and 'marker'")
        out.append(ZoneMarker(str(item["zone"]), str(item["marker"]), bool(item.get("after"))))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class CallDiagnosis:
    session_id: str
    index: int
    timestamp_s: float
    prompt_tokens: int
    reuse_tokens: int
    ideal_tokens: int
    divergence: int | None
    divergence_zone: str | None
    lost_tokens: int
    gap_s: float | None

    @property
    def breaks_layout(self) -> bool:
        return self.lost_tokens > 0


@dataclass(frozen=True, slots=True)
class SessionDiagnosis:
    session_id: str
    calls: tuple[CallDiagnosis, ...]

    @property
    def prompt_tokens(self) -> int:
        return sum(c.prompt_tokens for c in self.calls)

    @property
    def reuse_rate(self) -> float:
        total = self.prompt_tokens
        return sum(c.reuse_tokens for c in self.calls) / total if total else 0.0

    @property
    def ideal_rate(self) -> float:
        total = self.prompt_tokens
        return sum(c.ideal_tokens for c in self.calls) / total if total else 0.0

    @property
    def breaks(self) -> tuple[CallDiagnosis, ...]:
        return tuple(c for c in self.calls if c.breaks_layout)

    @property
    def lost_tokens(self) -> int:
        return sum(c.lost_tokens for c in self.calls)

    @property
    def gaps_s(self) -> list[float]:
        return [c.gap_s for c in self.calls if c.gap_s is not None]


@dataclass(frozen=True, slots=True)
class GapSummary:
    count: int
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float
    mean_s: float

    @classmethod
    def of(cls, gaps: Sequence[float]) -> GapSummary:
        if not gaps:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        a = np.asarray(gaps, dtype=float)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(len(a), float(p50), float(p90), float(p99), float(a.max()), float(a.mean()))


@dataclass(frozen=True, slots=True)
class TraceDiagnosis:
    block_size: int
    sessions: tuple[SessionDiagnosis, ...]
    gaps: GapSummary
    zones: dict[str, int] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.sessions)

    @property
    def reuse_rate(self) -> float:
        total = self.prompt_tokens
        return sum(s.reuse_rate * s.prompt_tokens for s in self.sessions) / total if total else 0.0

    @property
    def ideal_rate(self) -> float:
        total = self.prompt_tokens
        return sum(s.ideal_rate * s.prompt_tokens for s in self.sessions) / total if total else 0.0

    @property
    def breaking_sessions(self) -> tuple[SessionDiagnosis, ...]:
        return tuple(s for s in self.sessions if s.breaks)

    def to_json(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "prompt_tokens": self.prompt_tokens,
            "reuse_rate": self.reuse_rate,
            "ideal_hit_rate": self.ideal_rate,
            "tool_wait": asdict(self.gaps),
            "divergence_zones": dict(self.zones),
            "breaking_sessions": [s.session_id for s in self.breaking_sessions],
            "sessions": [
                {
                    "session_id": s.session_id,
                    "prompt_tokens": s.prompt_tokens,
                    "reuse_rate": s.reuse_rate,
                    "ideal_hit_rate": s.ideal_rate,
                    "lost_tokens": s.lost_tokens,
                    "calls": [asdict(c) for c in s.calls],
                }
                for s in self.sessions
            ],
        }


def zone_starts(text: str, markers: Sequence[ZoneMarker]) -> list[tuple[int, str]]:
    """(offset, zone) of every marker found in ``text``, sorted by offset."""
    starts = []
    for m in markers:
        i = text.find(m.marker)
        if i >= 0:
            starts.append((i + len(m.marker) if m.after else i, m.zone))
    return sorted(starts)


def zone_at(offset: int, starts: Sequence[tuple[int, str]]) -> str:
    k = bisect.bisect_right([s for s, _ in starts], offset) - 1
    return starts[k][1] if k >= 0 else "head"


def _first_diff(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    if isinstance(a, str) and isinstance(b, str):
        lo, hi = 0, n
        while lo < hi:  # binary search on prefix equality: O(n log n) char compares in C
            mid = (lo + hi + 1) // 2
            if a[:mid] == b[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def diagnose(
    calls: Sequence[TraceInput],
    block_size: int = 16,
    markers: Sequence[ZoneMarker] = DEFAULT_ZONES,
) -> TraceDiagnosis:
    """Diagnose calls of any number of sessions (ordered by timestamp within each)."""
    if block_size < 1:
        raise ConfigError(f"block size must be >= 1, got {block_size}")
    ordered = sorted(range(len(calls)), key=lambda i: calls[i].timestamp_s)
    ideal = dict(
        zip(ordered, ideal_hits([calls[i].tokens for i in ordered], block_size), strict=True)
    )
    by_session: dict[str, list[int]] = {}
    for i in ordered:
        by_session.setdefault(calls[i].session_id, []).append(i)
    zones: Counter[str] = Counter()
    sessions = []
    for sid, idx in by_session.items():
        out: list[CallDiagnosis] = []
        for k, i in enumerate(idx):
            call = calls[i]
            if k == 0:
                out.append(
                    CallDiagnosis(
                        sid, 0, call.timestamp_s, len(call.tokens), 0, ideal[i], None, None, 0, None
                    )
                )
                continue
            prev = calls[idx[k - 1]]
            div = _first_diff(prev.tokens, call.tokens)
            usable = (len(call.tokens) - 1) // block_size * block_size
            reuse = min(div // block_size * block_size, usable)
            appended = div >= len(prev.tokens)
            lost = 0
            if not appended and div < len(prev.tokens) - block_size:
                possible = min(len(prev.tokens) // block_size * block_size, usable)
                lost = max(0, possible - reuse)
            zone = _zone(prev, call, div, block_size, markers)
            zones[zone] += 1
            out.append(
                CallDiagnosis(
                    sid,
                    k,
                    call.timestamp_s,
                    len(call.tokens),
                    reuse,
                    ideal[i],
                    div,
                    zone,
                    lost,
                    call.timestamp_s - prev.timestamp_s,
                )
            )
        sessions.append(SessionDiagnosis(sid, tuple(out)))
    gaps = [g for s in sessions for g in s.gaps_s]
    return TraceDiagnosis(block_size, tuple(sessions), GapSummary.of(gaps), dict(zones))


def _zone(
    prev: TraceInput, call: TraceInput, div: int, block: int, markers: Sequence[ZoneMarker]
) -> str:
    if prev.text is None or call.text is None:
        # Hashed traces hash a partial last block as a whole: a divergence inside it is an
        # append as far as anyone can tell.
        return APPENDED if div >= len(prev.tokens) // block * block else UNKNOWN
    char = _first_diff(prev.text, call.text)
    if char >= len(prev.text):
        return APPENDED
    return zone_at(char, zone_starts(prev.text, markers))


_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def short_id(session_id: str, width: int = 12) -> str:
    s = _SAFE.sub("_", session_id)
    return s if len(s) <= width else s[: width - 1] + "…"


def render_diagnosis(console: Console, d: TraceDiagnosis, turns: bool = False) -> None:
    """The diagnosis as rich tables: per session, the breaking calls, optionally every call."""
    table = Table(title=f"prefix reuse per session (block {d.block_size})", title_justify="left")
    for col in (
        "session",
        "calls",
        "prompt tok",
        "reuse prev",
        "ideal",
        "breaks",
        "lost tok",
        "gap p50",
    ):
        table.add_column(col, justify="left" if col == "session" else "right")
    for s in d.sessions:
        gaps = s.gaps_s
        gap = f"{sorted(gaps)[len(gaps) // 2]:.1f} s" if gaps else "-"
        table.add_row(
            short_id(s.session_id),
            str(len(s.calls)),
            f"{s.prompt_tokens:,}",
            f"{s.reuse_rate:.1%}",
            f"{s.ideal_rate:.1%}",
            str(len(s.breaks)),
            f"{s.lost_tokens:,}",
            gap,
        )
    table.add_row(
        "all",
        str(sum(len(s.calls) for s in d.sessions)),
        f"{d.prompt_tokens:,}",
        f"{d.reuse_rate:.1%}",
        f"{d.ideal_rate:.1%}",
        str(sum(len(s.breaks) for s in d.sessions)),
        f"{sum(s.lost_tokens for s in d.sessions):,}",
        "",
        style="bold",
    )
    console.print(table)
    g = d.gaps
    console.print(
        f"tool wait (gap between calls): n={g.count}, p50 {g.p50_s:.2f} s, p90 {g.p90_s:.2f} s, "
        f"p99 {g.p99_s:.2f} s, max {g.max_s:.2f} s"
    )
    zones = ", ".join(f"{k}: {v}" for k, v in sorted(d.zones.items(), key=lambda kv: -kv[1]))
    console.print(f"where consecutive calls first differ: {zones or '-'}")
    breaking = d.breaking_sessions
    if breaking:
        bt = Table(title="calls that break the prefix (layout problems)", title_justify="left")
        for col in ("session", "call", "diverges at", "of prev", "zone", "lost tok"):
            bt.add_column(col)
        for s in breaking:
            for c in s.breaks:
                prev = s.calls[c.index - 1].prompt_tokens
                bt.add_row(
                    short_id(s.session_id),
                    str(c.index),
                    f"{c.divergence:,}",
                    f"{c.divergence / prev:.0%}" if prev else "-",
                    c.divergence_zone or "-",
                    f"{c.lost_tokens:,}",
                )
        console.print(bt)
    else:
        console.print("no session breaks its prefix: every call extends the previous one")
    if turns:
        tt = Table(title="calls", title_justify="left")
        for col in ("session", "call", "tokens", "reuse", "ideal", "diverges at", "zone", "gap"):
            tt.add_column(col)
        for s in d.sessions:
            for c in s.calls:
                tt.add_row(
                    short_id(s.session_id),
                    str(c.index),
                    f"{c.prompt_tokens:,}",
                    f"{c.reuse_tokens:,}",
                    f"{c.ideal_tokens:,}",
                    "-" if c.divergence is None else f"{c.divergence:,}",
                    c.divergence_zone or "-",
                    "-" if c.gap_s is None else f"{c.gap_s:.2f} s",
                )
        console.print(tt)
