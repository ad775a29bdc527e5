"""The workload both runs of bench_pause.py replay: trace sessions with their real waits.

Each miniswe call is one session turn whose context is the call's input and output (teacher
forced: contexts grow exactly as in the trace). Text becomes tokens by a fixed hash of each
4-character chunk (prefix-stable like a real BPE, about as dense; the CPU run takes longer
chunks, so its contexts cost less to compute). The pause after a turn is the trace's own gap
after that call, named by the tool it ran, plus a tail of human approvals
(`kvpilot.trace.waits.WaitModel`) on one time factor. More sessions than the trace holds are
its sessions again (``replicas``), each copy with its own approval draws; `dilated` stretches
every wait by one factor (the CPU run's: its compute is that many times slower than the
target node's, so the waits are too).
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from pathlib import Path

from kvpilot.errors import ConfigError
from kvpilot.trace import load_trace_calls
from kvpilot.trace.loader import TraceSession
from kvpilot.trace.waits import WaitModel

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces" / "lmcache-agent-trace" / "miniswe"
CHARS_PER_TOKEN = 4


def tokenize(
    text: str, vocab: int, chars_per_token: int = CHARS_PER_TOKEN, seed: int = 0
) -> list[int]:
    """A prefix-stable stand-in for BPE: each ``chars_per_token``-byte chunk hashes to a
    token id (another ``seed``, other ids: the same text in another agent's words)."""
    raw = text.encode("utf-8", errors="replace")
    step = chars_per_token
    return [zlib.crc32(raw[i : i + step], seed) % vocab for i in range(0, len(raw), step)]


@dataclass(frozen=True, slots=True)
class Turn:
    tokens: list[int]  # the whole context of the call: input and the trace's output
    wait_s: float  # the pause before the session's next call (0 after its last)
    tool: str


def load_sessions(
    n: int,
    max_tokens: int,
    waits: WaitModel,
    vocab: int,
    max_turns: int = 1 << 30,
    *,
    chars_per_token: int = CHARS_PER_TOKEN,
    replicas: int = 1,
) -> list[list[Turn]]:
    """Up to ``n`` trace sessions of 2 turns or more, cut where a call's context exceeds
    ``max_tokens`` or after ``max_turns`` calls; with ``replicas`` > 1 the trace's sessions
    come again, copy r with the approvals of ``waits`` seeded ``seed * 1000 + r`` (copy 0
    has ``waits``' own) and its text tokenized with hash seed r: a copy shares prefixes with
    the other sessions of its copy as the trace's sessions do (their system prompt), and
    none with another copy's, as another agent's sessions would not."""
    traces = list(load_trace_calls(TRACES))
    sessions = []
    for copy in range(replicas):
        model = waits if copy == 0 else dataclasses.replace(waits, seed=waits.seed * 1000 + copy)
        for trace in traces:
            turns = trace_turns(trace, model, vocab, max_tokens, max_turns, chars_per_token, copy)
            if len(turns) >= 2:
                sessions.append(turns)
            if len(sessions) == n:
                return sessions
    return sessions


def trace_turns(
    trace: TraceSession,
    waits: WaitModel,
    vocab: int,
    max_tokens: int,
    max_turns: int,
    chars_per_token: int,
    seed: int = 0,
) -> list[Turn]:
    """One trace session's turns, cut where a context exceeds ``max_tokens`` or after
    ``max_turns``; the last turn has no pause after it."""
    pauses = waits.waits(trace)
    turns = []
    for i, call in enumerate(trace.calls):
        tokens = tokenize(call.input + call.output, vocab, chars_per_token, seed)
        if len(tokens) > max_tokens or i == max_turns:
            break
        pause = pauses[i] if i < len(pauses) else None
        turns.append(Turn(tokens, pause.wait_s if pause else 0.0, pause.tool if pause else ""))
    if turns:
        turns[-1] = Turn(turns[-1].tokens, 0.0, turns[-1].tool)
    return turns


def dilated(sessions: list[list[Turn]], factor: float) -> list[list[Turn]]:
    """Every wait ``factor`` times as long (tokens and tools as they were)."""
    if not factor > 0:
        raise ConfigError(f"a wait dilation must be positive, got {factor}")
    return [[Turn(t.tokens, t.wait_s * factor, t.tool) for t in s] for s in sessions]


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
