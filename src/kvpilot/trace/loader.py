"""Load agent traces recorded as JSONL: one model call per line.

The miniswe traces (`shared/traces/lmcache-agent-trace/miniswe/`) carry ``timestamp``
(microseconds), ``input`` (the full prompt text), ``output`` and ``session_id``.
Calls are grouped per session and ordered by timestamp.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from kvpilot.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TraceCall:
    session_id: str
    timestamp_s: float
    input: str
    output: str


@dataclass(frozen=True, slots=True)
class TraceSession:
    session_id: str
    calls: tuple[TraceCall, ...]

    @property
    def gaps_s(self) -> list[float]:
        """Time from each call to the next: generation plus tool time."""
        ts = [c.timestamp_s for c in self.calls]
        return [b - a for a, b in itertools.pairwise(ts)]


def load_trace_calls(*paths: Path | str) -> list[TraceSession]:
    """Read JSONL files (or folders of them); sessions in order of their first call."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("*.jsonl"))
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError(f"trace path {p} does not exist")
    by_session: dict[str, list[TraceCall]] = defaultdict(list)
    for f in files:
        for lineno, line in enumerate(f.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                call = TraceCall(
                    session_id=str(row.get("session_id", f.stem)),
                    timestamp_s=float(row["timestamp"]) / 1e6,
                    input=str(row["input"]),
                    output=str(row.get("output", "")),
                )
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ConfigError(f"{f}:{lineno}: not a trace call ({exc})") from exc
            by_session[call.session_id].append(call)
    sessions = [
        TraceSession(sid, tuple(sorted(calls, key=lambda c: c.timestamp_s)))
        for sid, calls in by_session.items()
    ]
    return sorted(sessions, key=lambda s: s.calls[0].timestamp_s)
