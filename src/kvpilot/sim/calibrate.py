"""`kvpilot calibrate`: measure the real engine's per-iteration cost and fit a step profile.

The real engine (a local checkpoint, by default the built-in ``tiny``, on CPU) runs a fixed
set of batches across context length up to the model's limit (attention's cost grows with
the context, and its quadratic term only shows at long ones): lone prefills of many
lengths, prefills continuing a cached prefix, decode batches of 1-16 sequences at short
contexts and of 1-4 at half and most of the limit, each both on distinct contexts and
sharing a prefix as agent sessions share a system prompt (a shared prefix stays in the
CPU's cache and reads faster: at equal KV read, the pairs separate ``kv_read_tokens`` from
``distinct_kv_tokens``), and decodes mixed with a prefill chunk. Every `Engine.step` is
timed whole (scheduler and bookkeeping included, which is what the simulator's clock must
account for), and the profile is the least-squares fit, in relative error (weighted by the
fitted time, so the mean step time comes out unbiased: see `fit_profile`) and with
non-negative coefficients, of::

    step_s = a + b * prefill_tokens + c * decode_seqs + d * kv_read_tokens + e * attention_pairs
             + f * distinct_kv_tokens

A replay of a trace on the real engine and on the simulator with that profile (same engine
config, same KV pool) then compares throughput and prefix hit rate (`check_replay` in
`kvpilot.sim.replay_check`, once). The machine's speed drifts (by 10-30% within minutes on a
shared one), so `kvpilot calibrate --check` and bench_sim measure with `kvpilot.sim.paired`:
the calibration steps interleaved with repeated real replays, exposing both to the same drift.

Time is measured as this process's CPU time, with torch on one thread: on a shared machine
wall time also counts other processes' turns on the cores, which is noise the profile must
not learn. A real replay's time is its steps' CPU time (`StepClock`): what the simulator
models, without the harness that drives it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.engine import Engine
from kvpilot.engine.sampling import SamplingParams
from kvpilot.sim.fit import fit_profile
from kvpilot.sim.measured import (
    CALIBRATION_CONFIG,
    StepClock,
    StepSample,
    TimedExecutor,
    block_size_of,
    real_engine,
    torch_threads,
    warm_up,
)
from kvpilot.sim.profile import StepProfile
from kvpilot.sim.replay_check import ReplayCheck, check_replay

__all__ = [
    "CALIBRATION_CONFIG",
    "ReplayCheck",
    "StepClock",
    "StepSample",
    "TimedExecutor",
    "calibrate",
    "calibration_steps",
    "check_replay",
    "fit_profile",
    "measure_copy",
    "real_engine",
    "tokenizer_of",
    "torch_threads",
    "warm_up",
]


@dataclass(frozen=True, slots=True)
class _Episode:
    """Batches of prompts (with max_tokens), each submitted together and run to completion
    in turn, on an empty prefix cache: later batches reuse what earlier ones cached."""

    batches: list[list[tuple[list[int], int]]]


def _long_contexts(limit: int, fractions: tuple[float, ...]) -> list[int]:
    """Context lengths at ``fractions`` of ``limit``, past the short episodes' 2,000."""
    return sorted({int(limit * f) for f in fractions if int(limit * f) > 2000})


def _episodes(
    rng: random.Random, vocab: int, quick: bool, limit: int, capacity: int
) -> list[_Episode]:
    """The calibration batches for a model whose sequences may reach ``limit`` tokens, on a
    KV pool of ``capacity`` tokens."""

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
    # Agent sessions share a system prompt: decodes whose contexts share their first three
    # quarters read those blocks once into the CPU's cache and run faster than distinct ones
    # (measured both ways, so that the fit can tell ``distinct_kv_tokens`` apart).
    for bs in (b for b in batch_sizes if 1 < b <= 4):
        for ctx in (c for c in contexts if c >= 800):
            head = prompt(ctx * 3 // 4)
            batch = [([*head, *prompt(ctx - len(head))], decode_steps) for _ in range(bs)]
            episodes.append(_Episode([[(head, 1)], batch]))
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
    # Each sequence on its own context, as concurrent sessions are, and the same batches all
    # reading one shared prefix, which stays in the CPU's cache and reads up to 1.8x faster
    # per token: at equal KV read, the fit tells the two apart (``distinct_kv_tokens``).
    long_batches = (1, 4) if quick else (1, 2, 4)
    width = max(long_batches)
    fits = (capacity - 1500) // width  # the distinct contexts and the mixed batch fit the pool
    for n in sorted({min(n, fits) for n in _long_contexts(room, (0.85,) if quick else (0.5, 0.9))}):
        bases = [prompt(n) for _ in range(width)]
        batches = [[(base, 1)] for base in bases]
        batches += [
            [([*base, *prompt(8)], decode_steps) for base in bases[:bs]] for bs in long_batches
        ]
        batches.append([([*base, *prompt(20)], 24) for base in bases] + [(prompt(1100), 2)])
        episodes.append(_Episode(batches))
        head = bases[0]
        for bs in (b for b in long_batches if b > 1):
            episodes.append(
                _Episode([[(head, 1)], [([*head, *prompt(8)], decode_steps) for _ in range(bs)]])
            )
    return episodes


def _timed_steps(
    engine: Engine, timed: TimedExecutor, prompts: list[tuple[list[int], int]]
) -> Iterator[StepSample]:
    """Submit ``prompts`` together and step until all finish, yielding each timed step."""
    pending = {
        engine.add_request(p, SamplingParams(max_tokens=k, ignore_eos=True)) for p, k in prompts
    }
    while pending:
        timed.last_shape = None
        t0 = time.process_time()
        outputs = engine.step()
        dt = time.process_time() - t0
        if timed.last_shape is not None:
            yield StepSample(timed.last_shape, dt)
        for o in outputs:
            if o.finished and o.request_id in pending:
                pending.discard(o.request_id)
                engine.pop_output(o.request_id)


def calibration_steps(
    engine: Engine,
    timed: TimedExecutor,
    *,
    seed: int = 0,
    quick: bool = False,
    rounds: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> Iterator[StepSample]:
    """Run the calibration episodes ``rounds`` times (shuffled, after a warm-up), yielding
    every step as it is timed (`kvpilot.sim.paired` interleaves them with replays). The
    prefix cache is emptied before each episode so hits are only the intended ones."""
    vocab = min(engine.vocab_size or 256, 250)
    rng = random.Random(seed)
    capacity = engine.kv.device.num_blocks * engine.kv.block_size
    limit = min(engine.max_model_len, capacity // 2)
    episodes = _episodes(rng, vocab, quick, limit, capacity)
    plan = [ep for _ in range(rounds or (1 if quick else 2)) for ep in episodes]
    rng.shuffle(plan)
    warm_up(engine)
    everything = engine.kv.device.num_blocks
    for i, episode in enumerate(plan):
        engine.kv.radix.evict(everything)
        for batch in episode.batches:
            yield from _timed_steps(engine, timed, batch)
        if on_progress is not None:
            on_progress(i + 1, len(plan))


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
        samples = list(
            calibration_steps(engine, timed, seed=seed, quick=quick, on_progress=on_progress)
        )
        copy_s = measure_copy(timed)
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


def measure_copy(timed: TimedExecutor, n: int = 64) -> float:
    """Seconds per block of a device-internal copy (fork tails), from a batch of copies."""
    pairs = [(i, i + n) for i in range(min(n, timed.num_blocks // 2))]
    if not pairs:
        return 0.0
    t0 = time.process_time()
    timed.inner.copy_blocks(pairs)
    return (time.process_time() - t0) / len(pairs)


def tokenizer_of(model: str | Path = "tiny") -> Callable[[str], list[int]]:
    """The model's own tokenizer as a text -> ids function (no special tokens)."""
    from kvpilot.model.loader import resolve_model_path
    from kvpilot.model.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path(model))
    return lambda text: list(tok.encode(text, add_special_tokens=False))
