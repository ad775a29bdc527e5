"""bench_pause's CPU run on the compute clock: pauses cost no real time, outputs stay exact."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from pause_cpu import Pools, calibrate, recompute, replay
from pause_workload import Turn

from kvpilot.emulate.target import emulation_target


def sessions(n: int, turns: int, wait_s: float) -> list[list[Turn]]:
    rng = random.Random(7)
    out = []
    for _ in range(n):
        tokens = [rng.randrange(256) for _ in range(150)]
        session = []
        for t in range(turns):
            session.append(Turn(list(tokens), wait_s if t < turns - 1 else 0.0, "ls"))
            tokens += [rng.randrange(256) for _ in range(40)]
        out.append(session)
    return out


@pytest.mark.parametrize("policy", ["breakeven", "drop"])
def test_a_replay_on_the_compute_clock_skips_its_pauses(policy: str) -> None:
    work = sessions(3, 3, wait_s=20.0)  # 40 s of pauses per session
    expected, rate, per_token, cpu = recompute("tiny", work, 24, "compute")
    assert rate > 0 and per_token > 0 and cpu > 0
    cal = calibrate(rate, per_token, emulation_target("h100-pcie5"), cpu)
    pools = Pools(device_blocks=40, host_blocks=24, disk_blocks=200)
    r = replay("tiny", policy, work, pools, cal, 10.0, expected, clock_name="compute")
    assert r["mismatches"] == 0 and r["resumes"] == 6
    assert r["elapsed_s"] >= 40.0  # the pauses are on the clock...
    assert r["wall_s"] < 30.0  # ...but not slept
    assert r["turns_per_s"] == pytest.approx(3 * 3 / r["elapsed_s"], rel=0.1)
    if policy == "drop":
        assert r["recomputed_tokens"] > 0
