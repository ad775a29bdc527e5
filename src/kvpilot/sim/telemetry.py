"""What the simulator records: finished turns, inter-token latencies, and samples over time.

Every ``sample_interval_s`` the simulator takes a sample: the engine's load gauges, and the
p50/p99 of the inter-token latencies (ITLs) and TTFTs since the previous sample. The gauges
are read at once; the percentiles need only what the sample saw, so `Telemetry` keeps that
(the ITLs moved out of the engine, where the turn log stood) and reduces pending samples in
batches: one conversion of their ITLs, one sort per window in place, and the percentiles
of every window as array operations (`window_p50_p99`), the same figures to the last bit
as `p50_p99` sample by sample. `Telemetry.flush` completes the columns (the simulator
flushes when its run ends).
"""

from __future__ import annotations

import math
import struct
from array import array
from dataclasses import dataclass, field

import numpy as np

# ITLs pending before a flush: bounds the Python floats held (~32 bytes each) between flushes.
FLUSH_ITLS = 1 << 15


def p50_p99(values: np.ndarray) -> tuple[float, float]:
    """``np.percentile(values, [50, 99])`` to the last bit (its default linear method), at a
    fraction of its cost on small arrays."""
    a = np.sort(values)
    last = len(a) - 1
    out = []
    for q in (0.5, 0.99):
        at = last * q
        lo = math.floor(at)
        x, y = float(a[lo]), float(a[min(lo + 1, last)])
        t, d = at - lo, y - x
        out.append(y - d * (1 - t) if t >= 0.5 else x + d * t)
    return out[0], out[1]


def window_p50_p99(
    values: np.ndarray, starts: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """`p50_p99` of each window ``values[starts[i] : starts[i] + sizes[i]]``, every window
    already sorted (NaN for an empty one): the same float operations, item by item, as
    array operations (numpy rounds each one as Python does, and fuses none)."""
    p50 = np.full(len(sizes), math.nan)
    p99 = np.full(len(sizes), math.nan)
    some = sizes > 0
    start, last = starts[some], sizes[some] - 1
    for q, out in ((0.5, p50), (0.99, p99)):
        at = last * q
        lo = np.floor(at).astype(np.int64)
        x = values[start + lo]
        y = values[start + np.minimum(lo + 1, last)]
        t = at - lo
        d = y - x
        out[some] = np.where(t >= 0.5, y - d * (1 - t), x + d * t)
    return p50, p99


@dataclass(slots=True)
class Samples:
    """Telemetry sampled over time (one row per sample; the percentile columns are complete
    once `Telemetry.flush` ran)."""

    time_s: list[float] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)  # U_KV: blocks allocated / total
    kv_held: list[float] = field(default_factory=list)  # not counting evictable cached blocks
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    resident: list[int] = field(default_factory=list)  # trajectories holding device KV
    itl_p50_s: list[float] = field(default_factory=list)  # over tokens since the last sample
    itl_p99_s: list[float] = field(default_factory=list)
    ttft_p50_s: list[float] = field(default_factory=list)  # over turns finished since then
    ttft_p99_s: list[float] = field(default_factory=list)

    def as_arrays(self) -> dict[str, np.ndarray]:
        return {name: np.asarray(getattr(self, name), dtype=float) for name in self.__slots__}


@dataclass(slots=True)
class TurnLog:
    """Per finished request: intended arrival, first token, finish, prompt/cached/output tokens."""

    arrival_s: array = field(default_factory=lambda: array("d"))
    first_token_s: array = field(default_factory=lambda: array("d"))
    finish_s: array = field(default_factory=lambda: array("d"))
    prompt_tokens: array = field(default_factory=lambda: array("q"))
    cached_tokens: array = field(default_factory=lambda: array("q"))
    output_tokens: array = field(default_factory=lambda: array("q"))

    def __len__(self) -> int:
        return len(self.finish_s)

    def ttft_s(self) -> np.ndarray:
        first = np.asarray(self.first_token_s)
        arrival = np.asarray(self.arrival_s)
        ok = ~np.isnan(first)
        return first[ok] - arrival[ok]


class Telemetry:
    """The ITL log (float32, in the engine's order) and the samples' percentile columns."""

    def __init__(self, samples: Samples, turns: TurnLog, flush_itls: int = FLUSH_ITLS) -> None:
        self.samples = samples
        self.turns = turns
        self.flush_itls = flush_itls
        self.itl_s = array("f")
        self._itls: list[float] = []  # pending samples' ITLs, end to end
        self._itl_ends: list[int] = []  # per pending sample: where its ITLs end in _itls
        self._turn_ends: list[int] = []  # per pending sample: the turn log's length then
        self._turn_mark = 0  # the turn log's length at the last sample flushed

    def take(self, itl_s: list[float]) -> None:
        """A sample is taken: move the engine's ITLs since the last one (``itl_s``, emptied
        in place: the engine may hold it) and note where the turn log stands."""
        itls = self._itls
        itls += itl_s
        itl_s.clear()
        self._itl_ends.append(len(itls))
        self._turn_ends.append(len(self.turns.finish_s))  # len(turns), without its call
        if len(itls) >= self.flush_itls:
            self.flush()

    def flush(self) -> None:
        """Complete the percentile columns for the samples taken so far."""
        self._flush_itls()
        self._flush_ttfts()

    def _flush_itls(self) -> None:
        itls, ends = self._itls, self._itl_ends
        if not ends:
            return
        # struct packs the floats as C doubles, ~3x faster than numpy converts a list.
        values = np.frombuffer(struct.pack(f"{len(itls)}d", *itls))
        itls.clear()
        # Rounded to float32 to nearest, as array("f") would, 4 bytes each to bound memory.
        self.itl_s.frombytes(values.astype(np.float32).data.cast("B"))
        stops = np.array(ends, dtype=np.int64)
        ends.clear()
        self._percentiles(values, stops, self.samples.itl_p50_s, self.samples.itl_p99_s)

    def _flush_ttfts(self) -> None:
        ends = self._turn_ends
        if not ends:
            return
        begin, end = self._turn_mark, ends[-1]
        first = np.asarray(self.turns.first_token_s[begin:end])
        ttft = first - np.asarray(self.turns.arrival_s[begin:end])
        ok = ~np.isnan(first)
        # Window i's turns are those logged between samples i-1 and i; dropping the ones
        # without a first token moves each window's end by the drops before it.
        kept = np.concatenate(([0], np.cumsum(ok)))
        stops = kept[np.array(ends, dtype=np.int64) - begin]
        self._turn_mark = end
        ends.clear()
        self._percentiles(ttft[ok], stops, self.samples.ttft_p50_s, self.samples.ttft_p99_s)

    @staticmethod
    def _percentiles(
        values: np.ndarray, stops: np.ndarray, p50: list[float], p99: list[float]
    ) -> None:
        """Append `p50_p99` of each window ``values[stops[i-1] : stops[i]]``."""
        starts = np.concatenate(([0], stops[:-1]))
        values = values.copy()  # sorted window by window, in place
        for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
            if b - a > 1:
                values[a:b].sort()
        lo, hi = window_p50_p99(values, starts, stops - starts)
        p50 += lo.tolist()
        p99 += hi.tolist()
