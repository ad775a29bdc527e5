"""Measured inputs of the pause rule: link bandwidths, prefill rate, tool waits.

Each starts from a probe or a default and is refined online from what really happened,
so the break-even decision uses this machine's figures, not a datasheet's.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict, deque

from kvpilot.policy.pause_inputs import MAX_WAIT_S


class RateMeter:
    """An exponential moving average of a rate (bytes/s, tokens/s) from (amount, seconds).

    The one rate meter: link bandwidth, disk bandwidth (the disk store's), prefill rate. The
    first sample sets the average; until then ``get`` answers its default.
    """

    def __init__(self, initial: float | None = None, alpha: float = 0.3) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.value = initial
        self.alpha = alpha
        self.samples = 0

    def observe(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        self.add(amount / seconds)

    def add(self, rate: float) -> None:
        """One sample of the rate itself (`observe` of a positive amount and time)."""
        self.value = rate if self.value is None else self.value + self.alpha * (rate - self.value)
        self.samples += 1

    def get(self, default: float) -> float:
        return self.value if self.value is not None else default


# The prefill rate assumed before any is measured (tokens a second).
DEFAULT_PREFILL_TOKENS_PER_S = 2_000.0


class PrefillRateMeter:
    """Prefill tokens/s by context length (buckets), measured from real steps."""

    BOUNDS = (1024, 4096, 16384, 65536)

    def __init__(self) -> None:
        self.buckets = [RateMeter() for _ in range(len(self.BOUNDS) + 1)]
        self.overall = RateMeter()

    def observe(self, prefill_tokens: int, seconds: float, context_tokens: int) -> None:
        # Every engine step with a prefill: the rate checked and worked out once for both.
        if prefill_tokens <= 0 or seconds <= 0:
            return
        rate = prefill_tokens / seconds
        self.buckets[bisect.bisect_left(self.BOUNDS, context_tokens)].add(rate)
        self.overall.add(rate)

    def tokens_per_s(self, context_tokens: int, default: float) -> float:
        meter = self.buckets[bisect.bisect_left(self.BOUNDS, context_tokens)]
        if meter.value is not None:
            return meter.value
        return self.overall.get(default)


class WaitPredictor:
    """Predicts a tool's wait from the median of its recent observed waits.

    Falls back to all tools' recent waits, then to ``default_s``.
    """

    def __init__(self, default_s: float = 1.0, window: int = 64) -> None:
        self.default_s = default_s
        self.by_tool: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=window))
        self.all: deque[float] = deque(maxlen=window)

    def observe(self, tool: str | None, wait_s: float) -> None:
        if not wait_s >= 0:
            return
        if wait_s > MAX_WAIT_S:  # min(wait_s, MAX_WAIT_S) without the builtin
            wait_s = MAX_WAIT_S
        if tool:
            self.by_tool[tool].append(wait_s)
        self.all.append(wait_s)

    def predict(self, tool: str | None) -> tuple[float, str]:
        """(predicted wait, where it came from)."""
        if tool and self.by_tool.get(tool):
            return statistics.median(self.by_tool[tool]), f"median of {tool!r} waits"
        if self.all:
            return statistics.median(self.all), "median of all tools' waits"
        return self.default_s, "default (no waits observed yet)"
