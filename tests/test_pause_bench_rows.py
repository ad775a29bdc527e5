"""bench_pause's rows: medians over draws or repetitions, resume percentiles over every resume."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_pause
import pause_sim


def row(turns_per_s: float, resumes: list[float]) -> dict[str, Any]:
    return {
        "turns_per_s": turns_per_s,
        "recomputed_tokens": 10,
        "p50_resume_ttft_s": pause_sim.pct(resumes, 0.5),
        "p99_resume_ttft_s": pause_sim.pct(resumes, 0.99),
        "idle_gb_s": 1.0,
        "bytes_moved": {"device_to_host": 5},
        "decisions": {},
        pause_sim.RESUMES: resumes,
    }


def test_resume_percentiles_pool_every_draws_resumes() -> None:
    # Three draws of 100 resumes: the first two have one slow resume each, the third none.
    # Each draw's p99 is its slowest resume but one; pooled, the p99 is the third slowest.
    fast = [0.01] * 98
    draws = [
        {"breakeven": row(1.0, [*fast, 0.5, 2.0])},
        {"breakeven": row(3.0, [*fast, 0.6, 3.0])},
        {"breakeven": row(2.0, [*fast, 0.02, 0.03])},
    ]
    out = pause_sim.median_rows(draws)["breakeven"]
    assert out["turns_per_s"] == 2.0  # the median draw
    pooled = sorted(t for d in draws for t in d["breakeven"][pause_sim.RESUMES])
    assert out["p99_resume_ttft_s"] == round(pause_sim.pct(pooled, 0.99), 4)
    assert out["p99_resume_ttft_s"] == 0.6  # not the median of the draws' p99s
    assert out["p50_resume_ttft_s"] == 0.01
    assert out["bytes_moved"] == {"device_to_host": 5}


def test_cpu_run_rows_pool_every_repetitions_resumes() -> None:
    fast = [0.01] * 98
    runs = [row(1.0, [*fast, 0.5, 2.0]), row(3.0, [*fast, 0.6, 3.0]), row(2.0, [*fast, 0.02, 0.03])]
    for r, mismatches in zip(runs, (0, 1, 0), strict=True):
        r.update(mismatches=mismatches, cpu_s=1.0, achieved_link_ratio=62.0)
        r["achieved_disk_ratio"] = 0.85
    out = bench_pause.median_row(runs)
    assert out["turns_per_s"] == 2.0
    assert out["p99_resume_ttft_s"] == 0.6
    assert out["p50_resume_ttft_s"] == 0.01
    assert out["mismatches"] == 1
    assert out["turns_per_s_range"] == (1.0, 3.0)
