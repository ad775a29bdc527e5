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

Calls are compared through the prefix-break classifier the server uses
(`kvpilot.promptcache`): a session that mixes several conversations (an orchestrator and its
sub-agents, a user simulator and an agent) is split into them, reuse is counted per
conversation, and a switch between conversations is not a break. A call *breaks the layout*
when it diverges more than one block before the end of its conversation's previous call; it
carries the classified cause (volatile field at the head, tool list changed, compaction, ...).
The report (`kvpilot.trace.report`) shows the top N sessions and breaks, with counts of the
rest.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvpilot.errors import ConfigError
from kvpilot.promptcache.breaks import BreakCause, PromptView
from kvpilot.promptcache.conversations import BreakDetector
from kvpilot.promptcache.volatile import common_prefix_chars
from kvpilot.trace.ideal import ideal_hits
from kvpilot.trace.schema import TraceInput

APPENDED = "appended"
DEFAULT_TOP = 10  # rows per table in the report
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
    conversation: int = 0
    cause: str | None = None  # the classified cause of a divergence (`BreakCause`)
    detail: str | None = None

    @property
    def breaks_layout(self) -> bool:
        return self.lost_tokens > 0


@dataclass(frozen=True, slots=True)
class ConversationReuse:
    number: int
    calls: int
    prompt_tokens: int
    reuse_rate: float


@dataclass(frozen=True, slots=True)
class SessionDiagnosis:
    session_id: str
    calls: tuple[CallDiagnosis, ...]
    conversations: tuple[ConversationReuse, ...] = ()

    @property
    def interleaved(self) -> bool:
        """The session mixes several conversations."""
        return len(self.conversations) > 1

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

    @property
    def interleaved_sessions(self) -> tuple[SessionDiagnosis, ...]:
        return tuple(s for s in self.sessions if s.interleaved)

    @property
    def causes(self) -> dict[str, int]:
        """Breaks by cause (switches between interleaved conversations included)."""
        counts: Counter[str] = Counter(
            c.cause for s in self.sessions for c in s.calls if c.cause is not None
        )
        return dict(counts.most_common())

    def to_json(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "prompt_tokens": self.prompt_tokens,
            "reuse_rate": self.reuse_rate,
            "ideal_hit_rate": self.ideal_rate,
            "tool_wait": asdict(self.gaps),
            "divergence_zones": dict(self.zones),
            "causes": self.causes,
            "breaking_sessions": [s.session_id for s in self.breaking_sessions],
            "interleaved_sessions": [s.session_id for s in self.interleaved_sessions],
            "sessions": [
                {
                    "session_id": s.session_id,
                    "prompt_tokens": s.prompt_tokens,
                    "reuse_rate": s.reuse_rate,
                    "ideal_hit_rate": s.ideal_rate,
                    "lost_tokens": s.lost_tokens,
                    "conversations": [asdict(c) for c in s.conversations],
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
        return common_prefix_chars(a, b)
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
        detector = BreakDetector(block_size)
        last_of: dict[int, TraceInput] = {}  # each conversation's previous call
        out: list[CallDiagnosis] = []
        for k, i in enumerate(idx):
            call = calls[i]
            seen = detector.observe(PromptView(call.tokens, call.text))
            prev = last_of.get(seen.conversation)
            last_of[seen.conversation] = call
            gap = call.timestamp_s - calls[idx[k - 1]].timestamp_s if k else None
            brk = seen.prefix_break
            cause = str(brk.cause) if brk is not None else None
            detail = brk.detail if brk is not None else None
            if prev is None:
                out.append(
                    CallDiagnosis(
                        sid,
                        k,
                        call.timestamp_s,
                        len(call.tokens),
                        0,
                        ideal[i],
                        None,
                        None,
                        0,
                        gap,
                        seen.conversation,
                        cause,
                        detail,
                    )
                )
                continue
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
            if brk is not None and brk.cause is BreakCause.INTERLEAVED:
                lost = 0  # a switch back to this conversation, not a break of it
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
                    gap,
                    seen.conversation,
                    cause,
                    detail,
                )
            )
        conversations = tuple(
            ConversationReuse(c.number, c.requests, c.prompt_tokens, c.reuse_rate)
            for c in detector.all_conversations()
        )
        sessions.append(SessionDiagnosis(sid, tuple(out), conversations))
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
