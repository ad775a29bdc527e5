"""Calibration paced against replays: both see the same drift of the machine's speed."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvpilot.errors import ConfigError
from kvpilot.sim.batch_shape import BatchShape
from kvpilot.sim.fit import fit_profile
from kvpilot.sim.measured import StepSample
from kvpilot.sim.paired import Pacer, PairedCheck
from kvpilot.sim.replay_check import ReplayCheck

TRUE = (3e-3, 1e-4, 2e-4, 0.8e-6, 1e-7, 0.5e-6)


def cost(shape: BatchShape) -> float:
    return sum(c * f for c, f in zip(TRUE, shape.features(), strict=True))


def plan_shapes(seed: int) -> list[BatchShape]:
    """Calibration-like shapes: prefills, decode batches, mixed, over several contexts."""
    shapes = []
    for p in (0, 16, 200, 512):
        for d in (0, 1, 4, 12):
            for ctx in (0, 300, 1500, 6000):
                if p == 0 and d == 0:
                    continue
                seqs = d + (1 if p else 0)
                shape = BatchShape(seqs, p, d, ctx * seqs, p * p // 2 + d * ctx)
                shapes.append(shape)
                if d > 1 and ctx:  # the same decodes sharing three quarters of their context
                    shapes.append(shape._replace(shared_kv_tokens=(seqs - 1) * ctx * 3 // 4))
    random.Random(seed).shuffle(shapes)
    return shapes


def fixed_plan(seconds: list[float]) -> Iterator[StepSample]:
    for s in seconds:
        yield StepSample(BatchShape(1, 0, 1, 0, 1), s)


def test_pacer_keeps_calibration_time_at_the_ratio() -> None:
    pacer = Pacer(lambda k: fixed_plan([0.1] * 1000), ratio=2.0, quantum_s=0.0)
    for _ in range(50):
        pacer.replayed(0.037)
        assert 2.0 * pacer.replay_s <= pacer.calibration_s < 2.0 * pacer.replay_s + 0.1 + 1e-9


def test_pacer_waits_for_a_quantum_then_catches_up() -> None:
    pacer = Pacer(lambda k: fixed_plan([0.01] * 1000), ratio=1.0, quantum_s=0.25)
    pacer.replayed(0.2)
    assert pacer.calibration_s == 0.0
    pacer.replayed(0.1)
    assert pacer.calibration_s == pytest.approx(0.3)


def test_pacer_restarts_the_plan_and_counts_whole_plans() -> None:
    made: list[int] = []

    def plans(k: int) -> Iterator[StepSample]:
        made.append(k)
        return fixed_plan([1.0, 2.0, 3.0])

    pacer = Pacer(plans, quantum_s=0.0)
    pacer.replayed(12.5)  # two plans (12 s) and the first step of a third
    assert (pacer.plans_done, made) == (2, [0, 1, 2])
    assert [s.seconds for s in pacer.samples] == [1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0]


def test_pacer_rejects_an_empty_plan_and_bad_settings() -> None:
    pacer = Pacer(lambda k: fixed_plan([1.0] if k == 0 else []), quantum_s=0.0)
    with pytest.raises(ConfigError, match="no step"):
        pacer.replayed(5.0)
    with pytest.raises(ConfigError):
        Pacer(lambda k: fixed_plan([1.0]), ratio=0.0)


class DriftingMachine:
    """Step times = the true cost times the machine's slowness at that moment (a virtual
    clock that both the calibration and the replay advance)."""

    def __init__(self, slow_from: float, slow_until: float, factor: float) -> None:
        self.now = 0.0
        self.window = (slow_from, slow_until)
        self.factor = factor

    def run(self, shape: BatchShape) -> float:
        slow = self.window[0] <= self.now < self.window[1]
        seconds = cost(shape) * (self.factor if slow else 1.0)
        self.now += seconds
        return seconds

    def plan(self, k: int) -> Iterator[StepSample]:
        for shape in plan_shapes(k):
            yield StepSample(shape, self.run(shape))


def replay_shapes() -> list[BatchShape]:
    """A replay: decode steps of 1-4 sessions at growing contexts, a prefill chunk now and
    then."""
    shapes = []
    for i in range(600):
        n = 1 + i % 4
        ctx = 1000 + 5 * i
        if i % 40 == 0:
            shapes.append(BatchShape(n + 1, 512, n, n * ctx + 800, 512 * 800 + n * ctx))
        else:
            shapes.append(BatchShape(n, 0, n, n * ctx, n * (ctx + 1)))
    return shapes


def replay_error(samples: list[StepSample], real_s: float, shapes: list[BatchShape]) -> float:
    coef = fit_profile(samples, model="drift").coefficients_s
    predicted = sum(sum(c * f for c, f in zip(coef, s.features(), strict=True)) for s in shapes)
    return predicted / real_s - 1.0


def test_pacing_exposes_fit_and_replay_to_the_same_drift() -> None:
    """The machine is 30% slower for a stretch in the middle. Fitted first and replayed
    after, the replay lands in the slow stretch and the profile is ~15% optimistic; paced,
    both sample it alike and the profile predicts the replay within a few percent."""
    shapes = replay_shapes()
    total = sum(cost(s) for s in shapes)
    one_plan = sum(cost(s) for s in plan_shapes(0))
    span = (one_plan + total) * 1.15
    window = (0.55 * span, 0.95 * span)

    machine = DriftingMachine(*window, factor=1.3)
    samples = list(machine.plan(0))
    sequential = replay_error(samples, sum(machine.run(s) for s in shapes), shapes)

    machine = DriftingMachine(*window, factor=1.3)
    pacer = Pacer(machine.plan, ratio=one_plan / total, quantum_s=0.05)
    real_s = 0.0
    for shape in shapes:
        seconds = machine.run(shape)
        real_s += seconds
        pacer.replayed(seconds)
    paced = replay_error(pacer.samples, real_s, shapes)
    assert sequential < -0.1
    assert abs(paced) < 0.03, (paced, sequential)


def check(real_s: float, sim_s: float) -> ReplayCheck:
    return ReplayCheck(6, 100, 900, real_s, sim_s, 1000, 1000, 0.5, 0.5)


def test_paired_check_sums_passes_and_signs_their_errors() -> None:
    paired = PairedCheck((check(10.0, 11.0), check(12.0, 11.0)))
    assert paired.total.real_makespan_s == 22.0
    assert paired.total.sim_makespan_s == 22.0
    assert paired.total.real_tokens == paired.total.sim_tokens == 2000
    assert paired.total.throughput_error == pytest.approx(0.0)
    assert paired.pass_errors == pytest.approx([10 / 11 - 1, 12 / 11 - 1])
    assert paired.pass_errors[1] > 0  # the simulator faster than the real pass: optimistic


def test_slowness_is_measured_over_predicted_time_of_the_steps_alongside() -> None:
    from kvpilot.sim.paired import slowness
    from kvpilot.sim.profile import StepProfile

    profile = StepProfile("t", "cpu", "float32", 16, TRUE, 0.0, 10, 1.0, 0.0)
    shapes = plan_shapes(0)[:20]
    assert slowness(profile, [StepSample(s, 1.25 * cost(s)) for s in shapes]) == pytest.approx(1.25)
    assert slowness(profile, []) == 1.0


def test_steady_errors_take_out_the_drift_the_calibration_saw() -> None:
    """A pass that ran 20% fast while the calibration steps alongside ran 20% fast too has
    no error left; one that ran at the profile's speed keeps its own."""
    paired = PairedCheck((check(8.0, 10.0), check(11.0, 10.0)), slowness=(0.8, 1.0))
    assert paired.pass_errors == pytest.approx([-0.2, 0.1])
    assert paired.steady_errors == pytest.approx([0.0, 0.1])
