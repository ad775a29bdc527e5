"""Recorded agent traces as replayable sessions of token-id calls.

Each recorded session is replayed as an engine session (see `kvpilot.sim.drivers.
ReplayDriver`): a call whose prompt extends what the session holds is its next turn; one
that does not (a resent history, whose recorded reply differs from what the simulated model
generated) restarts the session on the whole prompt, and the radix cache finds what it
shares with earlier calls, as a real server's would.

Calls with an empty prompt are dropped (counted in ``ReplaySession.empty_calls``). The
replay limits of `ReplayOptions` (``max_sessions``, ``max_calls``, ``max_call_tokens``,
``head_tokens``, ``max_output_tokens``) are the CLI's ``--sessions``, ``--calls``,
``--max-call-tokens``, ``--head-tokens`` and ``--max-output-tokens``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.errors import ConfigError
from kvpilot.trace.loader import load_trace_calls
from kvpilot.trace.schema import (
    HASH_BLOCK_TOKENS,
    CharsPerToken,
    detect_trace_format,
    hashed_tokens,
    load_hashed_trace,
)

Tokenize = Callable[[str], list[int]]


@dataclass(frozen=True, slots=True)
class ReplayCall:
    prompt: tuple[int, ...]
    output_tokens: int
    offset_s: float


@dataclass(frozen=True, slots=True)
class ReplaySession:
    session_id: str
    calls: tuple[ReplayCall, ...]
    empty_calls: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.prompt) for c in self.calls)


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """How to turn trace files into replay sessions.

    ``tokenize`` maps text to ids (default: `CharsPerToken` with ``chars_per_token``).
    ``head_tokens``/``max_call_tokens`` shrink a session to fit a small model: the prefix all
    its calls share is cut down to ``head_tokens`` (from its start, so prefix relations are
    unchanged), then calls longer than ``max_call_tokens`` end the session. A session keeps
    at most ``max_calls`` calls; at most ``max_sessions`` sessions with ``min_calls`` calls
    or more are replayed.
    """

    vocab_size: int = 32000
    tokenize: Tokenize | None = None
    chars_per_token: int = 4
    hash_block_tokens: int = HASH_BLOCK_TOKENS
    timestamp_unit: str = "s"
    max_output_tokens: int | None = None
    head_tokens: int | None = None
    max_call_tokens: int | None = None
    max_sessions: int | None = None
    max_calls: int | None = None
    min_calls: int = 1

    def __post_init__(self) -> None:
        for name in ("max_output_tokens", "head_tokens", "max_call_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.max_sessions is not None and self.max_sessions < 1:
            raise ConfigError(f"--sessions must be at least 1, got {self.max_sessions}")
        if self.max_calls is not None and self.max_calls < 1:
            raise ConfigError(f"--calls must be at least 1, got {self.max_calls}")

    def describe(self) -> str:
        """The limits in force, as the CLI flags that set them."""
        parts = [
            f"--{flag} {value:,}"
            for flag, value in (
                ("sessions", self.max_sessions),
                ("calls", self.max_calls),
                ("max-call-tokens", self.max_call_tokens),
                ("head-tokens", self.head_tokens),
                ("max-output-tokens", self.max_output_tokens),
            )
            if value is not None
        ]
        return " ".join(parts) if parts else "no limits"


def load_replay(paths: Sequence[Path | str], options: ReplayOptions) -> list[ReplaySession]:
    """Sessions of a text (miniswe) or hashed trace, in order of their first call."""
    if not paths:
        raise ConfigError("give at least one trace file or folder")
    formats = {detect_trace_format(p) for p in paths}
    if len(formats) > 1:
        raise ConfigError("do not mix text and hashed traces in one replay")
    if formats == {"text"}:
        raw = _text_sessions(paths, options)
    else:
        raw = _hashed_sessions(paths, options)
    sessions: list[ReplaySession] = []
    t0 = min((calls[0][2] for _, calls in raw if calls), default=0.0)
    shortest: int | None = None  # the shortest first call, for the error below
    for sid, all_calls in raw:
        calls = [c for c in all_calls if c[0]]
        empty = len(all_calls) - len(calls)
        prompts = [c[0] for c in calls]
        if prompts and (shortest is None or len(prompts[0]) < shortest):
            shortest = len(prompts[0])
        if options.head_tokens is not None or options.max_call_tokens is not None:
            prompts = shrink_session(prompts, options.head_tokens, options.max_call_tokens)
        if options.max_calls is not None:
            prompts = prompts[: options.max_calls]
        if len(prompts) < max(1, options.min_calls):
            continue
        replay = tuple(
            ReplayCall(tuple(p), _cap(out, options.max_output_tokens), ts - t0)
            for p, (_, out, ts) in zip(prompts, calls, strict=False)
        )
        sessions.append(ReplaySession(sid, replay, empty))
        if options.max_sessions is not None and len(sessions) >= options.max_sessions:
            break
    if not sessions:
        hint = f" (limits: {options.describe()}; min {options.min_calls} calls a session)"
        cap = options.max_call_tokens
        if shortest is not None and cap is not None and shortest > cap:
            hint += (
                f"; the shortest first call has {shortest:,} tokens: raise --max-call-tokens "
                f"or cut the shared head with --head-tokens"
            )
        raise ConfigError(f"the trace holds no session that fits the replay limits{hint}")
    return sessions


def _cap(n: int, cap: int | None) -> int:
    n = max(1, n)
    return n if cap is None else min(n, cap)


def _text_sessions(
    paths: Sequence[Path | str], options: ReplayOptions
) -> list[tuple[str, list[tuple[list[int], int, float]]]]:
    tokenize = options.tokenize or CharsPerToken(options.chars_per_token, options.vocab_size)
    out = []
    for session in load_trace_calls(*paths):
        calls = [(tokenize(c.input), len(tokenize(c.output)), c.timestamp_s) for c in session.calls]
        out.append((session.session_id, calls))
    return out


def _hashed_sessions(
    paths: Sequence[Path | str], options: ReplayOptions
) -> list[tuple[str, list[tuple[list[int], int, float]]]]:
    block = options.hash_block_tokens
    calls = load_hashed_trace(*paths, block_tokens=block, timestamp_unit=options.timestamp_unit)
    by_session: dict[str, list[tuple[list[int], int, float]]] = defaultdict(list)
    order: list[str] = []
    for call in calls:
        sid = call.session_id if call.session_id is not None else f"call-{call.line}"
        if sid not in by_session:
            order.append(sid)
        tokens = hashed_tokens(call, options.vocab_size, block)
        by_session[sid].append((tokens, call.output_length, call.timestamp_s))
    return [(sid, by_session[sid]) for sid in order]


def shrink_session(
    prompts: Sequence[Sequence[int]], head_tokens: int | None, max_call_tokens: int | None
) -> list[list[int]]:
    """Cut the prefix every call shares down to ``head_tokens``, then stop at the first call
    longer than ``max_call_tokens`` (later calls of an agent only grow)."""
    if not prompts:
        return []
    common = min(len(p) for p in prompts)
    first = prompts[0]
    for p in prompts[1:]:
        n = min(common, len(p))
        i = 0
        while i < n and p[i] == first[i]:
            i += 1
        common = i
    drop = max(0, common - head_tokens) if head_tokens is not None else 0
    out: list[list[int]] = []
    for p in prompts:
        q = list(p[drop:])
        if max_call_tokens is not None and len(q) > max_call_tokens:
            break
        out.append(q)
    return out
