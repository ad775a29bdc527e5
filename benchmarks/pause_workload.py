"""The workload both runs of bench_pause.py replay: trace sessions with their real waits.

Each miniswe call is one session turn whose context is the call's input and output (teacher
forced: contexts grow exactly as in the trace). Text becomes tokens by a fixed hash of each
4-character chunk (prefix-stable like a real BPE, about as dense). The pause after a turn is
the trace's own gap after that call, named by the tool it ran, plus a tail of human approvals
(`kvpilot.trace.waits.WaitModel`) on one time factor.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

from kvpilot.trace import load_trace_calls
from kvpilot.trace.waits import WaitModel

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces" / "lmcache-agent-trace" / "miniswe"
CHARS_PER_TOKEN = 4


def tokenize(text: str, vocab: int) -> list[int]:
    """A prefix-stable stand-in for BPE: each 4-character chunk hashes to a token id."""
    raw = text.encode("utf-8", errors="replace")
    step = CHARS_PER_TOKEN
    return [zlib.crc32(raw[i : i + step]) % vocab for i in range(0, len(raw), step)]


@dataclass(frozen=True, slots=True)
class Turn:
    tokens: list[int]  # the whole context of the call: input and the trace's output
    wait_s: float  # the pause before the session's next call (0 after its last)
    tool: str


def load_sessions(
    n: int, max_tokens: int, waits: WaitModel, vocab: int, max_turns: int = 1 << 30
) -> list[list[Turn]]:
    """Up to ``n`` trace sessions of 2 turns or more, cut where a call's context exceeds
    ``max_tokens`` or after ``max_turns`` calls."""
    sessions = []
    for trace in load_trace_calls(TRACES):
        pauses = waits.waits(trace)
        turns = []
        for i, call in enumerate(trace.calls):
            tokens = tokenize(call.input + call.output, vocab)
            if len(tokens) > max_tokens or i == max_turns:
                break
            pause = pauses[i] if i < len(pauses) else None
            turns.append(Turn(tokens, pause.wait_s if pause else 0.0, pause.tool if pause else ""))
        if len(turns) >= 2:
            last = turns[-1]
            turns[-1] = Turn(last.tokens, 0.0, last.tool)
            sessions.append(turns)
        if len(sessions) == n:
            break
    return sessions


def working_set_tokens(sessions: list[list[Turn]]) -> int:
    """Every session's largest context at once: what would have to fit to never move KV."""
    return sum(max(len(t.tokens) for t in s) for s in sessions)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def describe_waits(sessions: list[list[Turn]]) -> str:
    waits = [t.wait_s for s in sessions for t in s[:-1]]
    approvals = [t.wait_s for s in sessions for t in s[:-1] if t.tool == "approval"]
    tools = {t.tool for s in sessions for t in s[:-1]}
    return (
        f"{len(waits)} pauses over {len(tools)} tools: p10 {pct(waits, 0.1):.3g} s, p50 "
        f"{pct(waits, 0.5):.3g} s, p90 {pct(waits, 0.9):.3g} s, max {max(waits, default=0):.3g}"
        f" s; {len(approvals)} approvals"
    )


def agent_rate(sessions: list[list[Turn]], active_s: list[float]) -> float:
    """Turns per second of the agents together: each session's turns over its own active
    time, summed (as if every agent took a new task when its session ended). A makespan would
    measure only the slowest session's waits, the same under every policy."""
    return sum(len(s) / t for s, t in zip(sessions, active_s, strict=True) if t > 0)
