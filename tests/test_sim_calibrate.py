"""Calibration: a profile measured on the real engine predicts the real engine's replay."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.sim.calibrate import (
    StepSample,
    calibrate,
    check_replay,
    fit_profile,
    tokenizer_of,
)
from kvpilot.sim.cost_model import BatchShape
from kvpilot.sim.replay import ReplayOptions, load_replay

MINISWE = Path(__file__).resolve().parents[2] / "shared/traces/lmcache-agent-trace/miniswe"


def test_fit_recovers_known_coefficients_and_keeps_them_non_negative() -> None:
    true = (2e-3, 1e-4, 5e-4, 2e-6, 1e-8)
    samples = []
    for p in (0, 16, 200, 512):
        for d in (0, 1, 4, 12):
            for ctx in (0, 300, 1500):
                if p == 0 and d == 0:
                    continue
                shape = BatchShape(
                    d + (1 if p else 0), p, d, ctx * (d + (1 if p else 0)), p * p // 2 + d * ctx
                )
                t = sum(c * f for c, f in zip(true, shape.features(), strict=True))
                samples.append(StepSample(shape, t))
    profile = fit_profile(samples, model="synthetic")
    assert profile.coefficients_s == pytest.approx(true, rel=1e-6)
    assert profile.r2 == pytest.approx(1.0)
    assert profile.median_rel_error < 1e-9
    # A feature that only adds noise with a negative pull is dropped, not made negative.
    noisy = [
        StepSample(s.shape, s.seconds * (0.9 if s.shape.attention_pairs > 1e5 else 1.0))
        for s in samples
    ]
    assert min(fit_profile(noisy, model="synthetic").coefficients_s) >= 0


def test_fit_needs_enough_steps() -> None:
    from kvpilot.errors import ConfigError

    with pytest.raises(ConfigError, match="at least"):
        fit_profile([StepSample(BatchShape(1, 0, 1, 0, 1), 1e-3)], model="x")


@pytest.mark.slow
@pytest.mark.skipif(not MINISWE.is_dir(), reason="miniswe traces not present")
def test_calibrated_simulator_predicts_the_real_engine_replay() -> None:
    profile = calibrate("tiny", kv_blocks=1024, quick=True)
    assert profile.r2 > 0.8
    sessions = load_replay(
        [MINISWE],
        ReplayOptions(
            tokenize=tokenizer_of("tiny"),
            head_tokens=1024,
            max_call_tokens=2048,
            max_output_tokens=32,
            max_sessions=2,
            min_calls=3,
        ),
    )
    check = check_replay(profile, sessions, kv_blocks=1024)
    assert check.calls >= 6
    assert check.throughput_error < 0.15, check.to_json()
    assert check.hit_rate_error < 0.15, check.to_json()
    assert check.real_hit_rate > 0.5
