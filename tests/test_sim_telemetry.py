"""The simulator's telemetry: batched percentile columns equal sample-by-sample ones."""

from __future__ import annotations

import math
from array import array

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sim_simulator import setup, workload

from kvpilot.sim.build import build_engine
from kvpilot.sim.drivers import AgentDriver
from kvpilot.sim.simulator import Simulator
from kvpilot.sim.telemetry import Samples, Telemetry, TurnLog, p50_p99, window_p50_p99
from kvpilot.sim.workload import WorkloadConfig

FLOATS = st.floats(0.0, 50.0, allow_nan=False) | st.sampled_from([0.0, 0.25, 1e-9, 3.0])


def expected(values: list[float]) -> tuple[float, float]:
    return p50_p99(np.array(values, dtype=float)) if values else (math.nan, math.nan)


def same(a: list[float], b: list[float]) -> bool:
    return np.array_equal(np.array(a), np.array(b), equal_nan=True)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(FLOATS, max_size=40), min_size=1, max_size=12))
def test_window_percentiles_are_p50_p99_of_each_window(windows: list[list[float]]) -> None:
    values = np.array([x for w in windows for x in sorted(w)], dtype=float)
    sizes = np.array([len(w) for w in windows], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    p50, p99 = window_p50_p99(values, starts, sizes)
    want = [expected(w) for w in windows]
    assert same(p50.tolist(), [a for a, _ in want]) and same(p99.tolist(), [b for _, b in want])
    for w, a, b in zip(windows, p50, p99, strict=True):
        if w:
            assert (a, b) == tuple(np.percentile(np.array(w, dtype=float), [50, 99]))


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(FLOATS, max_size=30),  # ITLs the engine logged before the sample
            st.lists(st.tuples(FLOATS, FLOATS | st.just(math.nan)), max_size=5),  # turns
        ),
        min_size=1,
        max_size=15,
    ),
    flush_itls=st.integers(1, 60),
    flush_after=st.sets(st.integers(0, 14)),
)
def test_batched_columns_equal_sample_by_sample_ones(
    rows: list[tuple[list[float], list[tuple[float, float]]]],
    flush_itls: int,
    flush_after: set[int],
) -> None:
    """However samples are batched (by the ITL threshold, or flushes in between), each row's
    p50/p99 of ITLs and of TTFTs (turns without a first token left out) is what `p50_p99`
    gives on that sample's own window; the ITL log is their float32 in order."""
    samples, turns = Samples(), TurnLog()
    tel = Telemetry(samples, turns, flush_itls)
    want: list[tuple[tuple[float, float], tuple[float, float]]] = []
    logged: list[float] = []
    for i, (itls, finished) in enumerate(rows):
        for arrival, first in finished:
            turns.arrival_s.append(arrival)
            turns.first_token_s.append(first)
            turns.finish_s.append(0.0)
        ttfts = [f - a for a, f in finished if not math.isnan(f)]
        want.append((expected(itls), expected(ttfts)))
        logged += itls
        engine_list = list(itls)
        tel.take(engine_list)
        assert engine_list == []
        if i in flush_after:
            tel.flush()
    tel.flush()
    assert same(samples.itl_p50_s, [w[0][0] for w in want])
    assert same(samples.itl_p99_s, [w[0][1] for w in want])
    assert same(samples.ttft_p50_s, [w[1][0] for w in want])
    assert same(samples.ttft_p99_s, [w[1][1] for w in want])
    assert tel.itl_s.tobytes() == array("f", logged).tobytes()


def test_a_simulation_samples_the_percentiles_of_each_window() -> None:
    """End to end: every sample row's ITL and TTFT percentiles are `p50_p99` of the ITLs the
    engine logged and the turns that finished since the previous sample."""
    s = setup(kv_blocks=300, duration_s=40.0)
    wl: WorkloadConfig = workload(arrival={"concurrent": 10, "ramp_s": 2})
    engine, _ = build_engine(s, wl.vocab_size)
    sim = Simulator(engine, duration_s=s.duration_s, sample_interval_s=0.5)
    windows: list[tuple[list[float], int]] = []
    sample = sim._sample

    def recording_sample(now: float) -> None:
        windows.append((list(engine.stats.itl_s), len(sim.turns)))
        sample(now)

    sim._sample = recording_sample  # type: ignore[method-assign]
    sim.run(AgentDriver(wl, engine.max_model_len))
    ttft_all = np.asarray(sim.turns.first_token_s) - np.asarray(sim.turns.arrival_s)
    mark = 0
    rows = []
    for itls, end in windows:
        ttft = ttft_all[mark:end]
        rows.append((expected(itls), expected(ttft[~np.isnan(ttft)].tolist())))
        mark = end
    assert len(rows) == len(sim.samples.time_s) > 70
    assert sum(not math.isnan(r[0][0]) for r in rows) > 40
    assert sum(not math.isnan(r[1][0]) for r in rows) > 10
    assert same(sim.samples.itl_p50_s, [r[0][0] for r in rows])
    assert same(sim.samples.itl_p99_s, [r[0][1] for r in rows])
    assert same(sim.samples.ttft_p50_s, [r[1][0] for r in rows])
    assert same(sim.samples.ttft_p99_s, [r[1][1] for r in rows])
