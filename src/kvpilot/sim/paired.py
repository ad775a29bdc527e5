"""Calibration and the replays that check it, measured together (`calibrate_with_replays`).

A shared machine's speed drifts: the same steps take 10-30% longer for a minute when other
processes load the cores' caches and memory. Measured one after the other, a fit and a
replay see different machines, and the replay's error says more about the drift than about
the profile (back-to-back runs of the same profile and replay differed by up to 17%).

So the calibration steps run interleaved with the real replays (`Pacer`): after every
``quantum_s`` of replay step time, calibration steps run until their CPU time is ``ratio``
times the replays'. Both sides then sample the same stretches of the machine's speed. The
replays repeat (``passes``, and until one whole calibration plan has run; a plan that ends
first restarts, reshuffled), and each pass is compared with the simulator replaying the same
sessions on the fitted profile (deterministic: simulated once). The figure is the error of
all passes together, with the spread of the passes. Drift faster than a pass still shows in
each pass's error; `PairedCheck.steady_errors` divides it out with the calibration steps run
alongside that pass (their measured time over the profile's), which leaves the profile's
own error on the replay's shapes. The calibration plan in progress when
the last pass ends is cut there: its steps are a random part of a shuffled plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.engine.config import EngineConfig
from kvpilot.errors import ConfigError
from kvpilot.sim.calibrate import calibration_steps, measure_copy
from kvpilot.sim.fit import fit_profile
from kvpilot.sim.measured import (
    CALIBRATION_CONFIG,
    MeasuredEngine,
    StepSample,
    block_size_of,
    real_engine,
    torch_threads,
    warm_up,
)
from kvpilot.sim.profile import CalibratedCostModel, StepProfile
from kvpilot.sim.replay import ReplaySession
from kvpilot.sim.replay_check import ReplayCheck, ReplayRun, run_replay, simulated_engine


class Pacer:
    """Keeps the calibration's CPU time at ``ratio`` times the replays' as both proceed.

    ``plans(k)`` gives the ``k``-th calibration plan's steps, each timed as it runs (the
    iterator does the work); `replayed` is told each replay step's CPU seconds.
    """

    def __init__(
        self,
        plans: Callable[[int], Iterator[StepSample]],
        *,
        ratio: float = 1.0,
        quantum_s: float = 0.25,
    ) -> None:
        if ratio <= 0 or quantum_s < 0:
            raise ConfigError(f"pacing needs ratio > 0 and quantum >= 0, got {ratio}, {quantum_s}")
        self.ratio = ratio
        self.quantum_s = quantum_s
        self.samples: list[StepSample] = []
        self.plans_done = 0
        self.calibration_s = 0.0
        self.replay_s = 0.0
        self._plans = plans
        self._steps = plans(0)
        self._paced_at = 0.0

    def replayed(self, seconds: float) -> None:
        """A replay step took ``seconds``; once a quantum has gathered, catch up."""
        self.replay_s += seconds
        if self.replay_s - self._paced_at >= self.quantum_s:
            self.catch_up()

    def catch_up(self) -> None:
        """Run calibration steps until their time is ``ratio`` times the replays'."""
        self._paced_at = self.replay_s
        while self.calibration_s < self.ratio * self.replay_s:
            self._take()

    def _take(self) -> None:
        sample = next(self._steps, None)
        if sample is None:
            self.plans_done += 1
            self._steps = self._plans(self.plans_done)
            sample = next(self._steps, None)
            if sample is None:
                raise ConfigError("a calibration plan ran no step")
        self.samples.append(sample)
        self.calibration_s += sample.seconds


@dataclass(frozen=True, slots=True)
class PairedCheck:
    """One trace's replay: each real pass against the (deterministic) simulated replay."""

    passes: tuple[ReplayCheck, ...]
    # Per pass: the calibration steps run alongside it, their measured time over the fitted
    # profile's (> 1: the machine ran slower than on average while the pass ran).
    slowness: tuple[float, ...] = ()

    @property
    def total(self) -> ReplayCheck:
        """All passes together: summed real time and tokens against the simulator's, times
        the number of passes."""
        first, n = self.passes[0], len(self.passes)
        return ReplayCheck(
            first.calls,
            first.prompt_tokens_min,
            first.prompt_tokens_max,
            sum(p.real_makespan_s for p in self.passes),
            n * first.sim_makespan_s,
            sum(p.real_tokens for p in self.passes),
            n * first.sim_tokens,
            first.real_hit_rate,
            first.sim_hit_rate,
        )

    @property
    def pass_errors(self) -> list[float]:
        """Each pass's signed throughput error (simulated / real - 1)."""
        return [p.signed_error for p in self.passes]

    @property
    def steady_errors(self) -> list[float]:
        """Each pass's signed error with its real time divided by the slowness of the
        calibration steps run alongside: what is left when the drift both saw is taken out
        (the profile's own error on this replay's shapes, plus the noise of the slices)."""
        return [
            (p.signed_error + 1.0) / s - 1.0
            for p, s in zip(self.passes, self.slowness, strict=True)
        ]


@dataclass(frozen=True, slots=True)
class PairedCalibration:
    profile: StepProfile
    checks: dict[str, PairedCheck]
    plans: int  # whole calibration plans measured
    calibration_s: float  # CPU time of the calibration steps
    replay_s: float  # CPU time of the real replays' steps


def calibrate_with_replays(
    replays: Mapping[str, Sequence[ReplaySession]],
    model: str | Path = "tiny",
    *,
    kv_blocks: int = 2048,
    config: EngineConfig = CALIBRATION_CONFIG,
    seed: int = 0,
    quick: bool = False,
    passes: int = 2,
    ratio: float = 1.0,
    threads: int | None = 1,
    on_pass: Callable[[int], None] | None = None,
) -> PairedCalibration:
    """Fit ``model``'s step profile from calibration steps interleaved with ``passes`` (or
    more, until a whole plan has run) real replays of each of ``replays``; compare each pass
    with the simulator on the fitted profile."""
    if not replays or passes < 1:
        raise ConfigError("give at least one replay and one pass")
    with torch_threads(threads):
        fit_engine, timed = real_engine(model, kv_blocks=kv_blocks, config=config)
        pacer = Pacer(
            lambda k: calibration_steps(fit_engine, timed, seed=seed + k, quick=quick, rounds=1),
            ratio=ratio,
        )
        real: dict[str, list[ReplayRun]] = {name: [] for name in replays}
        alongside: dict[str, list[tuple[int, int]]] = {name: [] for name in replays}
        done = 0
        while done < passes or pacer.plans_done == 0:
            for name, sessions in replays.items():
                engine, _ = real_engine(model, kv_blocks=kv_blocks, config=config)
                warm_up(engine)
                assert isinstance(engine, MeasuredEngine)
                engine.after_step = pacer.replayed
                first = len(pacer.samples)
                real[name].append(run_replay(engine, sessions))
                pacer.catch_up()
                alongside[name].append((first, len(pacer.samples)))
            done += 1
            if on_pass is not None:
                on_pass(done)
        copy_s = measure_copy(timed)
    profile = fit_profile(
        pacer.samples,
        model=str(model),
        block_size=block_size_of(config),
        copy_block_s=copy_s,
        max_model_len=fit_engine.max_model_len,
        max_context_tokens=timed.max_context,
    )
    checks = {}
    for name, sessions in replays.items():
        sim = simulated_engine(profile, fit_engine, kv_blocks=kv_blocks, config=config)
        simulated = run_replay(sim, sessions)
        checks[name] = PairedCheck(
            tuple(ReplayCheck.of(sessions, run, simulated) for run in real[name]),
            tuple(slowness(profile, pacer.samples[a:b]) for a, b in alongside[name]),
        )
    return PairedCalibration(profile, checks, pacer.plans_done, pacer.calibration_s, pacer.replay_s)


def slowness(profile: StepProfile, samples: Sequence[StepSample]) -> float:
    """Measured time of ``samples`` over the time ``profile`` gives them (1.0 if none)."""
    model = CalibratedCostModel(profile)
    predicted = sum(model.step_time_s(s.shape) for s in samples)
    return sum(s.seconds for s in samples) / predicted if predicted > 0 else 1.0
