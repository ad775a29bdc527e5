"""Calibration: a profile measured on the real engine predicts the real engine's replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpilot.sim.batch_shape import BatchShape
from kvpilot.sim.calibrate import (
    StepSample,
    calibrate,
    check_replay,
    fit_profile,
    tokenizer_of,
)
from kvpilot.sim.replay import ReplayOptions, load_replay

MINISWE = Path(__file__).resolve().parents[2] / "shared/traces/lmcache-agent-trace/miniswe"


TRUE = (2e-3, 1e-4, 5e-4, 1.2e-6, 1e-8, 0.8e-6)


def true_steps() -> list[StepSample]:
    """Batch shapes over prefill, decode and context sizes (decodes on distinct contexts and
    sharing half of them: equal KV read, less distinct KV), each with its time under TRUE."""
    samples = []
    for p in (0, 16, 200, 512):
        for d in (0, 1, 4, 12):
            for ctx in (0, 300, 1500):
                if p == 0 and d == 0:
                    continue
                seqs = d + (1 if p else 0)
                shape = BatchShape(seqs, p, d, ctx * seqs, p * p // 2 + d * ctx)
                shapes = [shape]
                if d > 1 and ctx:  # the same decodes sharing half their context
                    shapes.append(shape._replace(shared_kv_tokens=(seqs - 1) * ctx // 2))
                for shape in shapes:
                    t = sum(c * f for c, f in zip(TRUE, shape.features(), strict=True))
                    samples.append(StepSample(shape, t))
    return samples


def test_fit_recovers_known_coefficients_and_keeps_them_non_negative() -> None:
    true, samples = TRUE, true_steps()
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


def test_fit_gets_the_mean_step_time_right_under_noise() -> None:
    """Each shape timed twice, 30% fast and 30% slow (a shared machine): the profile must
    predict their mean, since a replay's time is a sum of steps. Weighting by the measured
    time instead would pull every coefficient ~10% low."""
    samples = [StepSample(s.shape, f * s.seconds) for s in true_steps() for f in (0.7, 1.3)]
    profile = fit_profile(samples, model="noisy")
    assert profile.coefficients_s == pytest.approx(TRUE, rel=0.02)
    predicted = sum(
        sum(c * f for c, f in zip(profile.coefficients_s, s.shape.features(), strict=True))
        for s in samples
    )
    assert predicted == pytest.approx(sum(s.seconds for s in samples), rel=0.01)


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
    # A timing comparison on a shared machine: the bound here only catches a broken cost model
    # (wrong units, a missing term: errors of 2x and more). How close calibration gets is a
    # benchmark figure (benchmarks/bench_sim.py: calib_throughput_error_short/long).
    assert check.throughput_error < 0.5, check.to_json()
    assert check.hit_rate_error < 0.15, check.to_json()
    assert check.real_hit_rate > 0.5


def test_step_clock_runs_only_inside_engine_steps() -> None:
    from kvpilot.engine.sampling import SamplingParams
    from kvpilot.sim.calibrate import StepClock, real_engine

    engine, _ = real_engine("tiny", kv_blocks=64)
    clock = engine.clock
    assert isinstance(clock, StepClock)
    engine.add_request([5] * 40, SamplingParams(max_tokens=2, ignore_eos=True))
    before = clock.now()
    sum(i * i for i in range(300_000))  # harness work: not the engine's time
    assert clock.now() == before
    engine.step()
    after = clock.now()
    assert after > before
    clock.sleep(2.0)
    assert clock.now() == pytest.approx(after + 2.0)


def _profile(max_model_len: int = 8192) -> Any:
    from kvpilot.sim.profile import StepProfile

    return StepProfile(
        "tiny",
        "cpu",
        "float32",
        16,
        (1e-3, 1e-5, 1e-4, 0, 0, 0),
        1e-6,
        50,
        0.9,
        0.1,
        max_model_len=max_model_len,
    )


def test_calibrate_check_replays_up_to_the_models_limit(tmp_path, monkeypatch) -> None:
    """With a check, the CLI calibrates interleaved with the real replays (`paired`), on calls
    up to the model's limit less the output, and reports all passes together and each."""
    import json

    from typer.testing import CliRunner

    import kvpilot.sim.calibrate as cal
    import kvpilot.sim.paired as paired
    from kvpilot.cli import app

    seen: list[list[int]] = []
    asked: list[dict[str, object]] = []
    monkeypatch.setattr(cal, "tokenizer_of", lambda model: None)

    def fake_paired(replays: dict, model: object, **kw: object) -> object:
        (sessions,) = replays.values()
        seen.append([len(c.prompt) for s in sessions for c in s.calls])
        asked.append(kw)
        checks = (cal.ReplayCheck(1, 1, 1, 1.0, 1.1, 1, 1, 0.5, 0.5),) * 3
        check = paired.PairedCheck(checks, (1.0, 1.1, 1.0))
        return paired.PairedCalibration(_profile(), {"check": check}, 1, 2.0, 2.0)

    monkeypatch.setattr(paired, "calibrate_with_replays", fake_paired)
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: pytest.fail("not interleaved"))
    rows = [
        {
            "timestamp": float(i),
            "input_length": n,
            "output_length": 10,
            "hash_ids": list(range(n // 16)),
            "session_id": "s",
        }
        for i, n in enumerate((5000, 6000, 7000, 8150, 8170, 9000))
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    args = ["calibrate", "--out", str(tmp_path / "p.json"), "--trace", str(trace)]
    result = CliRunner().invoke(app, [*args, "--json", "--passes", "3"])
    assert result.exit_code == 0, result.output
    assert seen == [[5000, 6000, 7000, 8150]]  # up to tiny's 8,192 - 32 output tokens
    assert asked[0]["passes"] == 3
    check = json.loads(result.output)["check"]
    assert check["passes"] == 3 and len(check["pass_errors"]) == 3
    assert check["pass_errors"][0] == pytest.approx(1 / 1.1 - 1)
    assert (tmp_path / "p.json").is_file()
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "3 real passes interleaved" in " ".join(result.output.split())
    result = CliRunner().invoke(app, [*args, "--kv-blocks", "500"])  # 8,000 tokens of pool
    assert result.exit_code == 0, result.output
    assert seen[-1] == [5000, 6000, 7000]
    result = CliRunner().invoke(app, [*args, "--passes", "0"])
    assert result.exit_code == 2 and "--passes" in result.output
    assert len(asked) == 3  # refused before any work
    result = CliRunner().invoke(app, [*args, "--max-call-tokens", "4000"])
    assert result.exit_code == 2
    assert "the shortest first call has 5,000 tokens: raise --max-call-tokens" in " ".join(
        result.output.split()
    )


def test_calibrate_without_a_check_fits_alone(tmp_path, monkeypatch) -> None:
    import json

    from typer.testing import CliRunner

    import kvpilot.sim.calibrate as cal
    import kvpilot.sim.paired as paired
    from kvpilot.cli import app

    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: _profile())
    monkeypatch.setattr(paired, "calibrate_with_replays", lambda *a, **k: pytest.fail("paired"))
    out = tmp_path / "p.json"
    result = CliRunner().invoke(app, ["calibrate", "--out", str(out), "--no-check", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert "check" not in data and data["profile"] == str(out) and out.is_file()


@pytest.mark.parametrize("capacity", [32768, 16384])
def test_long_decode_batches_read_distinct_contexts_and_a_shared_one_that_fit_the_pool(
    capacity: int,
) -> None:
    """Concurrent sessions read their own contexts; agent sessions share a prefix, which
    stays in the CPU's cache and reads faster: each long batch size is measured both ways,
    so that the fit can tell ``kv_read_tokens`` from ``distinct_kv_tokens``."""
    import random

    from kvpilot.sim.calibrate import _episodes

    episodes = _episodes(random.Random(0), 250, False, 8192, capacity)
    long_batches = [
        batch
        for episode in episodes
        for batch in episode.batches
        if len(batch) > 1 and all(len(p) > 2000 for p, _ in batch)
    ]
    distinct = {len(b) for b in long_batches if len({tuple(p[:100]) for p, _ in b}) == len(b)}
    shared = {len(b) for b in long_batches if len({tuple(p[:-8]) for p, _ in b}) == 1}
    assert distinct >= {2, 4} and shared >= {2, 4}
    for batch in long_batches:
        assert sum(len(p) + k for p, k in batch) <= capacity  # all 4 run at once


def test_short_decodes_are_measured_distinct_and_sharing_a_head() -> None:
    """At equal KV read, the fit tells shared KV from distinct: it sees both kinds of short
    decode batch."""
    import random

    from kvpilot.sim.calibrate import _episodes

    episodes = _episodes(random.Random(0), 250, False, 8192, 32768)
    short = [
        batch
        for episode in episodes
        for batch in episode.batches
        if 1 < len(batch) <= 4 and all(800 <= len(p) <= 1500 for p, _ in batch)
    ]
    shared = [b for b in short if len({tuple(p[: len(p) * 3 // 4]) for p, _ in b}) == 1]
    distinct = [b for b in short if len({tuple(p[:50]) for p, _ in b}) == len(b)]
    assert len(shared) >= 4
    assert len(distinct) >= 4
