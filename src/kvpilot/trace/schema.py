"""Trace schemas and how each becomes token ids.

Two kinds of JSONL trace, one model call per line (docs/trace-schema.md):

* text traces (the miniswe recordings): ``timestamp`` (microseconds), ``input``, ``output``,
  ``session_id``; tokenized with a real tokenizer or `CharsPerToken`;
* hashed traces: ``timestamp``, ``input_length``, ``output_length``, ``hash_ids`` (one id per
  block of ``block_tokens`` prompt tokens, equal ids for equal blocks) and optional
  ``session_id``; the form production traces are published in, without their text.

`hashed_tokens` maps every hash id to a fixed block of synthetic token ids, so calls that
share hash ids share KV blocks in the engine exactly as they did in production.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvpilot.errors import ConfigError
from kvpilot.memory.hashing import block_hash, chain_hashes, root_hash
from kvpilot.trace.loader import load_trace_calls

HASH_BLOCK_TOKENS = 16
TIMESTAMP_UNITS: dict[str, float] = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
HASHED_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")

Tokenize = Callable[[str], list[int]]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN_INT = 0x9E3779B97F4A7C15
_GOLDEN = np.uint64(_GOLDEN_INT)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _to_ids(h: np.ndarray, vocab_size: int) -> list[int]:
    return (h % np.uint64(vocab_size - 1) + np.uint64(1)).astype(np.int64).tolist()


@dataclass(frozen=True, slots=True)
class HashedCall:
    session_id: str | None
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int = 0


def detect_trace_format(path: Path | str) -> str:
    """``"text"`` or ``"hashed"``, from the first record of a JSONL file (or folder of them)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"trace path {p} does not exist")
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    if not files:
        raise ConfigError(f"no .jsonl trace files in {p}")
    try:
        with files[0].open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    break
            else:
                raise ConfigError(f"trace file {files[0]} is empty")
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read trace {files[0]}: {exc}") from exc
    if not isinstance(row, dict):
        raise ConfigError(f"{files[0]}:1: a trace record is a JSON object")
    if "input" in row:
        return "text"
    if "hash_ids" in row:
        return "hashed"
    raise ConfigError(
        f"{files[0]}:1: neither a text trace (needs 'input') nor a hashed trace "
        f"(needs {', '.join(HASHED_FIELDS)}); see docs/trace-schema.md"
    )


def _trace_files(paths: Iterable[Path | str]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("*.jsonl"))
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError(f"trace path {p} does not exist")
    if not files:
        raise ConfigError("no trace files given")
    return files


def _nonneg_int(row: dict[str, Any], key: str, where: str) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    return value


def parse_hashed_call(
    row: Any, where: str, block_tokens: int = HASH_BLOCK_TOKENS, unit: str = "s"
) -> HashedCall:
    """One validated record of a hashed trace; ``where`` (file:line) prefixes every error."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a trace record is a JSON object, got {type(row).__name__}")
    missing = [k for k in HASHED_FIELDS if k not in row]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {missing}; see docs/trace-schema.md")
    ts = row["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise ConfigError(f"{where}: 'timestamp' must be a number, got {ts!r}")
    n_in = _nonneg_int(row, "input_length", where)
    n_out = _nonneg_int(row, "output_length", where)
    if n_in < 1:
        raise ConfigError(f"{where}: 'input_length' must be at least 1")
    ids = row["hash_ids"]
    if not isinstance(ids, list) or any(
        isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids
    ):
        raise ConfigError(f"{where}: 'hash_ids' must be a list of non-negative integers")
    if len(ids) > -(-n_in // block_tokens):
        raise ConfigError(
            f"{where}: {len(ids)} hash_ids cover more than input_length={n_in} tokens at "
            f"{block_tokens} tokens per block; is --hash-block-tokens right?"
        )
    sid = row.get("session_id")
    if sid is not None and not isinstance(sid, str | int):
        raise ConfigError(f"{where}: 'session_id' must be a string or an integer, got {sid!r}")
    return HashedCall(
        session_id=None if sid is None else str(sid),
        timestamp_s=float(ts) * TIMESTAMP_UNITS[unit],
        input_length=n_in,
        output_length=n_out,
        hash_ids=tuple(ids),
    )


def load_hashed_trace(
    *paths: Path | str, block_tokens: int = HASH_BLOCK_TOKENS, timestamp_unit: str = "s"
) -> list[HashedCall]:
    """Every call of the given files (or folders), in timestamp order."""
    if block_tokens < 1:
        raise ConfigError(f"hash block size must be >= 1 token, got {block_tokens}")
    if timestamp_unit not in TIMESTAMP_UNITS:
        raise ConfigError(f"timestamp unit must be one of {sorted(TIMESTAMP_UNITS)}")
    calls: list[HashedCall] = []
    for f in _trace_files(paths):
        with f.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                where = f"{f}:{lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{where}: not JSON ({exc})") from exc
                call = parse_hashed_call(row, where, block_tokens, timestamp_unit)
                calls.append(_with_line(call, len(calls)))
    calls.sort(key=lambda c: (c.timestamp_s, c.line))
    return calls


def _with_line(call: HashedCall, line: int) -> HashedCall:
    return HashedCall(
        call.session_id,
        call.timestamp_s,
        call.input_length,
        call.output_length,
        call.hash_ids,
        line,
    )


def hashed_tokens(
    call: HashedCall, vocab_size: int, block_tokens: int = HASH_BLOCK_TOKENS
) -> list[int]:
    """Synthetic token ids of a hashed call: hash id h -> the same ``block_tokens`` ids always.

    Tokens past the blocks the hash ids cover are unique to this call (keyed by its line).
    """
    ids = np.asarray(call.hash_ids, dtype=np.uint64)
    offsets = np.arange(block_tokens, dtype=np.uint64)
    blocks = _mix64(_mix64(ids * _GOLDEN)[:, None] + offsets[None, :]).reshape(-1)
    tokens = _to_ids(blocks[: call.input_length], vocab_size)
    rest = call.input_length - len(tokens)
    if rest > 0:
        seed = np.uint64((call.line + 1) * 0x2545F4914F6CDD1D % (1 << 64))
        tail = _mix64(
            np.full(rest, seed, dtype=np.uint64) ^ _mix64(np.arange(rest, dtype=np.uint64))
        )
        tokens += _to_ids(tail | np.uint64(1 << 63), vocab_size)
    return tokens


def block_hash_ids(tokens: Sequence[int], block_tokens: int = HASH_BLOCK_TOKENS) -> list[int]:
    """Chained hash ids (63-bit) of every block of ``tokens``, the partial tail included.

    Equal ids mean equal prefixes, so exporting a text trace through this keeps its sharing.
    """
    full = chain_hashes(tokens, block_tokens)
    out = [int.from_bytes(h[:8], "little") >> 1 for h in full]
    tail = len(tokens) % block_tokens
    if tail:
        parent = full[-1] if full else root_hash(None)
        out.append(int.from_bytes(block_hash(parent, tokens[-tail:])[:8], "little") >> 1)
    return out


@dataclass(frozen=True, slots=True)
class CharsPerToken:
    """A tokenizer stand-in: every ``chars`` characters make one token.

    Token boundaries sit at fixed character offsets, so two texts with a common prefix get
    token lists with a common prefix (up to the chunk where they differ), which is all the
    prefix cache needs. The token id is a hash of the chunk: equal chunks, equal ids.
    """

    chars: int = 4
    vocab_size: int = 32000

    def __post_init__(self) -> None:
        if self.chars < 1:
            raise ConfigError(f"chars per token must be >= 1, got {self.chars}")
        if self.vocab_size < 2:
            raise ConfigError("vocab_size must be >= 2")

    def __call__(self, text: str) -> list[int]:
        if not text:
            return []
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
        k = self.chars
        pad = (-len(cps)) % k
        if pad:
            cps = np.concatenate([cps, np.zeros(pad, dtype=np.uint64)])
        rows = cps.reshape(-1, k)
        h = np.zeros(len(rows), dtype=np.uint64)
        for j in range(k):
            h = _mix64(h ^ (rows[:, j] + np.uint64((j + 1) * _GOLDEN_INT % (1 << 64))))
        # The last, partial chunk hashes its length too, so "ab" and "ab\0" differ.
        if pad:
            h[-1:] = _mix64(h[-1:] ^ np.uint64(k - pad))
        return _to_ids(h, self.vocab_size)


@dataclass(frozen=True, slots=True)
class TraceInput:
    """One call, normalised: its tokens, and its text when the trace has it."""

    session_id: str
    timestamp_s: float
    tokens: list[int]
    text: str | None = None


def load_trace_inputs(
    paths: Sequence[Path | str],
    *,
    tokenize: Tokenize | None = None,
    chars_per_token: int = 4,
    vocab_size: int = 32000,
    hash_block_tokens: int = HASH_BLOCK_TOKENS,
    timestamp_unit: str = "s",
) -> list[TraceInput]:
    """Calls of a text or hashed trace, tokenized (text: ``tokenize`` or chars-per-token)."""
    formats = {detect_trace_format(p) for p in paths}
    if len(formats) > 1:
        raise ConfigError("do not mix text and hashed traces in one analysis")
    if formats == {"text"}:
        tok = tokenize or CharsPerToken(chars_per_token, vocab_size)
        return [
            TraceInput(s.session_id, c.timestamp_s, tok(c.input), c.input)
            for s in load_trace_calls(*paths)
            for c in s.calls
        ]
    calls = load_hashed_trace(*paths, block_tokens=hash_block_tokens, timestamp_unit=timestamp_unit)
    return [
        TraceInput(
            c.session_id if c.session_id is not None else f"call-{c.line}",
            c.timestamp_s,
            hashed_tokens(c, vocab_size, hash_block_tokens),
        )
        for c in calls
    ]
