"""A replay on the real engine against the same replay on the simulator with a step profile.

`check_replay` runs one of each (the real engine first, on its own `StepClock`: the CPU time
of its steps, what the simulator's clock models); `kvpilot.sim.paired` runs the real side
several times, interleaved with the calibration it checks. Both build their engines here:
same engine config, same KV pool, the simulator's executor charging the profile's times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvpilot.engine.clock import VirtualClock
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.engine import Engine
from kvpilot.sim.drivers import ReplayDriver
from kvpilot.sim.measured import (
    CALIBRATION_CONFIG,
    block_size_of,
    real_engine,
    torch_threads,
    warm_up,
)
from kvpilot.sim.profile import CalibratedCostModel, StepProfile
from kvpilot.sim.replay import ReplaySession
from kvpilot.sim.runner import SimulatedRunner
from kvpilot.sim.simulator import Simulator


class ReplayRun(NamedTuple):
    """What one back-to-back replay did: its makespan on the engine's clock, the tokens it
    computed, its prefix hit rate and the calls it sent."""

    makespan_s: float
    tokens: int
    hit_rate: float
    calls: int


@dataclass(frozen=True, slots=True)
class ReplayCheck:
    """The same replay on the real engine and on the simulator with a profile."""

    calls: int
    prompt_tokens_min: int
    prompt_tokens_max: int
    real_makespan_s: float
    sim_makespan_s: float
    real_tokens: int
    sim_tokens: int
    real_hit_rate: float
    sim_hit_rate: float

    @classmethod
    def of(cls, sessions: Sequence[ReplaySession], real: ReplayRun, sim: ReplayRun) -> ReplayCheck:
        lengths = [len(c.prompt) for s in sessions for c in s.calls]
        return cls(
            real.calls,
            min(lengths),
            max(lengths),
            real.makespan_s,
            sim.makespan_s,
            real.tokens,
            sim.tokens,
            real.hit_rate,
            sim.hit_rate,
        )

    @property
    def real_throughput(self) -> float:
        return self.real_tokens / self.real_makespan_s

    @property
    def sim_throughput(self) -> float:
        return self.sim_tokens / self.sim_makespan_s

    @property
    def throughput_error(self) -> float:
        return abs(self.sim_throughput - self.real_throughput) / self.real_throughput

    @property
    def signed_error(self) -> float:
        """Simulated throughput over real, less one: > 0 when the simulator is optimistic."""
        return self.sim_throughput / self.real_throughput - 1.0

    @property
    def hit_rate_error(self) -> float:
        if self.real_hit_rate == 0:
            return abs(self.sim_hit_rate)
        return abs(self.sim_hit_rate - self.real_hit_rate) / self.real_hit_rate

    def to_json(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "prompt_tokens_min": self.prompt_tokens_min,
            "prompt_tokens_max": self.prompt_tokens_max,
            "real_makespan_s": self.real_makespan_s,
            "sim_makespan_s": self.sim_makespan_s,
            "real_tokens_per_s": self.real_throughput,
            "sim_tokens_per_s": self.sim_throughput,
            "real_hit_rate": self.real_hit_rate,
            "sim_hit_rate": self.sim_hit_rate,
            "throughput_error": self.throughput_error,
            "hit_rate_error": self.hit_rate_error,
        }


def run_replay(engine: Engine, sessions: Sequence[ReplaySession]) -> ReplayRun:
    """Replay ``sessions`` back to back (counted from the engine's counters before and after,
    so earlier work does not count)."""
    stats = engine.stats
    computed0 = stats.prefill_tokens + stats.decode_tokens
    prompt0, cached0 = stats.prompt_tokens, stats.cached_tokens
    sim = Simulator(engine, duration_s=1e9, sample_interval_s=1e9)
    driver = ReplayDriver(list(sessions), time_scale=0.0)
    sim.run(driver)
    prompt = stats.prompt_tokens - prompt0
    hit = (stats.cached_tokens - cached0) / prompt if prompt else 0.0
    tokens = stats.prefill_tokens + stats.decode_tokens - computed0
    return ReplayRun(sim.now, tokens, hit, driver.calls)


def simulated_engine(
    profile: StepProfile, like: Engine, *, kv_blocks: int, config: EngineConfig
) -> Engine:
    """An engine on the simulator's executor with ``profile``, shaped like the real ``like``."""
    clock = VirtualClock()
    runner = SimulatedRunner(
        CalibratedCostModel(profile),
        clock,
        num_blocks=kv_blocks,
        block_size=block_size_of(config),
        vocab_size=like.vocab_size or 32000,
    )
    return Engine(
        runner,
        config,
        vocab_size=like.vocab_size,
        max_model_len=like.max_model_len,
        clock=clock,
    )


def check_replay(
    profile: StepProfile,
    sessions: Sequence[ReplaySession],
    *,
    model: str | Path = "tiny",
    kv_blocks: int = 2048,
    config: EngineConfig = CALIBRATION_CONFIG,
    threads: int | None = 1,
) -> ReplayCheck:
    """Replay ``sessions`` back to back on the real engine and on the simulator."""
    with torch_threads(threads):
        real, _ = real_engine(model, kv_blocks=kv_blocks, config=config)
        warm_up(real)
        real_run = run_replay(real, sessions)
    sim_run = run_replay(
        simulated_engine(profile, real, kv_blocks=kv_blocks, config=config), sessions
    )
    return ReplayCheck.of(sessions, real_run, sim_run)
