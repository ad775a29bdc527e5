"""`kvpilot calibrate`: measure the real engine's per-iteration cost and fit a step profile.

The real engine (a local checkpoint, by default the built-in ``tiny``, on CPU) runs a fixed
set of batches across context length up to the model's limit (attention's cost grows with
the context, and its quadratic term only shows at long ones): lone prefills of many
lengths, prefills continuing a cached prefix, decode batches of 1-16 sequences at short
contexts and at half and most of the limit (sharing one cached prefix, so that each long
context is prefilled once), and decodes mixed with a prefill chunk. Every `Engine.step` is
timed whole (scheduler and bookkeeping included, which is what the simulator's clock must
account for), and the profile is the least-squares fit, in relative error (weighted by the
fitted time, so the mean step time comes out unbiased: see `fit_profile`) and with
non-negative coefficients, of::

    step_s = a + b * prefill_tokens + c * decode_seqs + d * kv_read_tokens + e * attention_pairs

`check_replay` then replays the same trace on the real engine and on the simulator with that
profile (same engine config, same KV pool) and compares throughput and prefix hit rate.

Time is measured as this process's CPU time, with torch on one thread: on a shared machine
wall time also counts other processes' turns on the cores, which is noise the profile must
not learn. A real replay's time is its steps' CPU time (`StepClock`): what the simulator
models, without the harness that drives it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.engine.clock import VirtualClock
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.engine import Engine
from kvpilot.engine.sampling import SamplingParams
from kvpilot.sim.drivers import ReplayDriver
from kvpilot.sim.fit import fit_profile
from kvpilot.sim.measured import (
    CALIBRATION_CONFIG,
    StepClock,
    StepSample,
    TimedExecutor,
    block_size_of,
    real_engine,
    torch_threads,
)
from kvpilot.sim.profile import CalibratedCostModel, StepProfile
from kvpilot.sim.replay import ReplaySession
from kvpilot.sim.runner import SimulatedRunner
from kvpilot.sim.simulator import Simulator

__all__ = [
    "CALIBRATION_CONFIG",
    "ReplayCheck",
    "StepClock",
    "StepSample",
    "TimedExecutor",
    "calibrate",
    "check_replay",
    "fit_profile",
    "measure_steps",
    "real_engine",
    "tokenizer_of",
    "torch_threads",
]


@dataclass(frozen=True, slots=True)
class _Episode:
    """Batches of prompts (with max_tokens), each submitted together and run to completion
    in turn, on an empty prefix cache: later batches reuse what earlier ones cached."""

    batches: list[list[tuple[list[int], int]]]


def _long_contexts(limit: int, fractions: tuple[float, ...]) -> list[int]:
    """Context lengths at ``fractions`` of ``limit``, past the short episodes' 2,000."""
    return sorted({int(limit * f) for f in fractions if int(limit * f) > 2000})


def _episodes(rng: random.Random, vocab: int, quick: bool, limit: int) -> list[_Episode]:
    """The calibration batches for a model whose sequences may reach ``limit`` tokens."""

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    def one(prompts: list[tuple[list[int], int]]) -> _Episode:
        return _Episode([prompts])

    if quick:
        lengths: tuple[int, ...] = (16, 200, 512, 1200)
        continuations: tuple[tuple[int, int], ...] = ((1000, 60), (600, 300))
        batch_sizes: tuple[int, ...] = (1, 2, 4, 12)
        contexts: tuple[int, ...] = (64, 800, 1600)
        decode_steps = 6
        mixed: tuple[int, ...] = (3,)
    else:
        lengths = (16, 64, 200, 400, 512, 900, 1500, 2000)
        continuations = ((1000, 24), (600, 200), (1200, 450))
        batch_sizes = (1, 2, 4, 8, 16)
        contexts = (32, 300, 800, 1500)
        decode_steps, mixed = 12, (2, 6)
    episodes = [one([(prompt(n), 2)]) for n in lengths]
    for n, extra in continuations:
        base = prompt(n)
        episodes.append(_Episode([[(base, 1)], [([*base, *prompt(extra)], 2)]]))
    for bs in batch_sizes:
        for ctx in contexts:
            episodes.append(one([(prompt(ctx), decode_steps) for _ in range(bs)]))
    for bs in mixed:
        episodes.append(one([(prompt(300), 24) for _ in range(bs)] + [(prompt(1100), 2)]))
    # Long contexts, up to the model's limit (leaving room for the decodes).
    room = limit - 64
    for n in _long_contexts(room, (0.7,) if quick else (0.4, 0.7, 0.97)):
        episodes.append(one([(prompt(n), 2)]))
    for n in _long_contexts(room, () if quick else (0.75,)):
        base = prompt(n)
        episodes.append(_Episode([[(base, 1)], [([*base, *prompt(300)], 2)]]))
    # At most 4 long decodes at once: past ~30k tokens of context in one step the CPU reads
    # KV from memory, not cache, and a step costs up to 2.5x per token (12 sequences at 90%
    # of the limit); no linear profile fits both, and replays run a few sessions at a time.
    long_batches = (1, 4) if quick else (1, 2, 4)
    for n in _long_contexts(room, (0.85,) if quick else (0.5, 0.9)):
        base = prompt(n)
        batches = [[(base, 1)]]
        batches += [[([*base, *prompt(8)], decode_steps) for _ in range(bs)] for bs in long_batches]
        batches.append([([*base, *prompt(20)], 24) for _ in range(4)] + [(prompt(1100), 2)])
        episodes.append(_Episode(batches))
    return episodes


def _run_timed(
    engine: Engine,
    timed: TimedExecutor,
    prompts: list[tuple[list[int], int]],
    out: list[StepSample],
) -> None:
    pending = {
        engine.add_request(p, SamplingParams(max_tokens=k, ignore_eos=True)) for p, k in prompts
    }
    while pending:
        timed.last_shape = None
        t0 = time.process_time()
        outputs = engine.step()
        dt = time.process_time() - t0
        if timed.last_shape is not None:
            out.append(StepSample(timed.last_shape, dt))
        for o in outputs:
            if o.finished and o.request_id in pending:
                pending.discard(o.request_id)
                engine.pop_output(o.request_id)


def measure_steps(
    engine: Engine,
    timed: TimedExecutor,
    *,
    seed: int = 0,
    quick: bool = False,
    rounds: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[StepSample]:
    """Run the calibration episodes ``rounds`` times (shuffled, after a warm-up); time every
    step. The prefix cache is emptied before each episode so hits are only the intended ones."""
    vocab = min(engine.vocab_size or 256, 250)
    rng = random.Random(seed)
    limit = min(engine.max_model_len, engine.kv.device.num_blocks * engine.kv.block_size // 2)
    episodes = _episodes(rng, vocab, quick, limit)
    plan = [ep for _ in range(rounds or (1 if quick else 2)) for ep in episodes]
    rng.shuffle(plan)
    warm_up(engine, timed)
    samples: list[StepSample] = []
    everything = engine.kv.device.num_blocks
    for i, episode in enumerate(plan):
        engine.kv.radix.evict(everything)
        for batch in episode.batches:
            _run_timed(engine, timed, batch, samples)
        if on_progress is not None:
            on_progress(i + 1, len(plan))
    return samples


def calibrate(
    model: str | Path = "tiny",
    *,
    kv_blocks: int = 2048,
    config: EngineConfig = CALIBRATION_CONFIG,
    seed: int = 0,
    quick: bool = False,
    threads: int | None = 1,
    on_progress: Callable[[int, int], None] | None = None,
) -> StepProfile:
    """Measure ``model`` on the real engine and fit its step profile."""
    with torch_threads(threads):
        engine, timed = real_engine(model, kv_blocks=kv_blocks, config=config)
        samples = measure_steps(engine, timed, seed=seed, quick=quick, on_progress=on_progress)
        copy_s = _measure_copy(timed)
    return fit_profile(
        samples,
        model=str(model),
        device="cpu",
        dtype="float32",
        block_size=block_size_of(config),
        copy_block_s=copy_s,
        max_model_len=engine.max_model_len,
        max_context_tokens=timed.max_context,
    )


def _measure_copy(timed: TimedExecutor, n: int = 64) -> float:
    """Seconds per block of a device-internal copy (fork tails), from a batch of copies."""
    pairs = [(i, i + n) for i in range(min(n, timed.num_blocks // 2))]
    if not pairs:
        return 0.0
    t0 = time.process_time()
    timed.inner.copy_blocks(pairs)
    return (time.process_time() - t0) / len(pairs)


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


def warm_up(engine: Engine, timed: TimedExecutor) -> None:
    """A first batch pays torch's one-time costs: run one, then empty the prefix cache."""
    _run_timed(engine, timed, [([5] * 300, 4), ([6] * 40, 4)], [])
    engine.kv.radix.evict(engine.kv.device.num_blocks)


def _replay(engine: Engine, sessions: Sequence[ReplaySession]) -> tuple[float, int, float, int]:
    """Makespan, tokens computed, hit rate and calls of a back-to-back replay (counted from
    the engine's counters before and after, so earlier work does not count)."""
    stats = engine.stats
    computed0 = stats.prefill_tokens + stats.decode_tokens
    prompt0, cached0 = stats.prompt_tokens, stats.cached_tokens
    sim = Simulator(engine, duration_s=1e9, sample_interval_s=1e9)
    driver = ReplayDriver(list(sessions), time_scale=0.0)
    sim.run(driver)
    prompt = stats.prompt_tokens - prompt0
    hit = (stats.cached_tokens - cached0) / prompt if prompt else 0.0
    return sim.now, stats.prefill_tokens + stats.decode_tokens - computed0, hit, driver.calls


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
        real, timed = real_engine(model, kv_blocks=kv_blocks, config=config)
        warm_up(real, timed)
        real_s, real_tokens, real_hit, calls = _replay(real, sessions)
    clock = VirtualClock()
    runner = SimulatedRunner(
        CalibratedCostModel(profile),
        clock,
        num_blocks=kv_blocks,
        block_size=block_size_of(config),
        vocab_size=real.vocab_size or 32000,
    )
    simulated = Engine(
        runner,
        config,
        vocab_size=real.vocab_size,
        max_model_len=real.max_model_len,
        clock=clock,
    )
    sim_s, sim_tokens, sim_hit, _ = _replay(simulated, sessions)
    lengths = [len(c.prompt) for s in sessions for c in s.calls]
    return ReplayCheck(
        calls,
        min(lengths),
        max(lengths),
        real_s,
        sim_s,
        real_tokens,
        sim_tokens,
        real_hit,
        sim_hit,
    )


def tokenizer_of(model: str | Path = "tiny") -> Callable[[str], list[int]]:
    """The model's own tokenizer as a text -> ids function (no special tokens)."""
    from kvpilot.model.loader import resolve_model_path
    from kvpilot.model.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path(model))
    return lambda text: list(tok.encode(text, add_special_tokens=False))
