"""Decode speed from token timestamps, measured the same way for every engine.

Each request's tokens are stamped when the engine hands them to the caller (kvpilot's and
vLLM's step loops, transformers' streamer). A request's decode time is its last token's stamp
minus its first's, which cannot be negative whatever the noise (the old figure, a full run's
time minus a prefill-only run's, could). A batch decodes at its decode tokens (every
request's tokens after its first) over its requests' mean decode time: batch size over the
mean time per output token. Standard library only: vLLM's worker imports it too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenClock:
    """First and last token stamps and token counts, per request."""

    first: dict[Hashable, float] = field(default_factory=dict)
    last: dict[Hashable, float] = field(default_factory=dict)
    count: dict[Hashable, int] = field(default_factory=dict)

    def seen(self, request: Hashable, total_tokens: int, now: float | None = None) -> None:
        """``request`` has produced ``total_tokens`` tokens so far (stamped if that is new)."""
        if total_tokens <= self.count.get(request, 0):
            return
        stamp = time.perf_counter() if now is None else now
        self.first.setdefault(request, stamp)
        self.last[request] = stamp
        self.count[request] = total_tokens

    def summary(self) -> dict[str, list[float] | list[int]]:
        """Per request, in first-token order: decode seconds and tokens (JSON-ready)."""
        order = sorted(self.first, key=self.first.__getitem__)
        return {
            "decode_spans_s": [self.last[r] - self.first[r] for r in order],
            "tokens_per_request": [self.count[r] for r in order],
        }


def decode_tokens_per_s(summary: Mapping[str, list[float] | list[int]]) -> float:
    """Decode tokens over the mean decode time of the requests (see the module docstring)."""
    spans = [float(s) for s in summary["decode_spans_s"]]
    tokens = [int(n) for n in summary["tokens_per_request"]]
    if not spans or min(spans) < 0:
        raise AssertionError(f"decode spans must be non-negative, got {spans[:4]}")
    decode_tokens = sum(n - 1 for n in tokens)
    mean = statistics.fmean(spans)
    if decode_tokens <= 0 or mean <= 0:
        raise AssertionError(f"no decode to time: {decode_tokens} tokens in {mean} s")
    return decode_tokens / mean


def assert_same_tokens(counts: Mapping[str, list[int]], want_each: int, batch: int) -> None:
    """Every side of a comparison produced ``want_each`` tokens for each of ``batch`` requests."""
    for side, got in counts.items():
        if sorted(got) != [want_each] * batch:
            raise AssertionError(
                f"{side} produced {sorted(got)} tokens per request; every side must produce "
                f"{want_each} for each of {batch} requests"
            )
