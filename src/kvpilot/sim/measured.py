"""The real engine as calibration measures it: its own CPU time per step (`StepClock`,
`MeasuredEngine`), the shape of each batch (`TimedExecutor`), on one torch thread, after a
`warm_up`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.engine.config import DEFAULT_BLOCK_SIZE, EngineConfig
from kvpilot.engine.engine import Engine
from kvpilot.engine.executor import Executor, SeqWork, StepOutput
from kvpilot.engine.request import RequestOutput
from kvpilot.engine.sampling import SamplingParams
from kvpilot.sim.batch_shape import BatchShape, batch_shape

CALIBRATION_CONFIG = EngineConfig.from_kwargs(max_num_batched_tokens=1024, max_prefill_chunk=512)


def block_size_of(config: EngineConfig) -> int:
    return config.runner.block_size or DEFAULT_BLOCK_SIZE


class StepClock:
    """The real engine's own time: this process's CPU time spent inside `Engine.step`, plus
    idle time (``sleep`` adds it without waiting).

    Calibration fits whole steps and the simulator charges nothing else, so on the real side
    the harness that drives a replay (event loop, driver, submissions) must not count either:
    only `MeasuredEngine.step` runs the clock.
    """

    def __init__(self) -> None:
        self._done = 0.0
        self._idle = 0.0
        self._since: float | None = None
        self.last_s = 0.0  # the CPU time of the last `running` stretch (the last step)

    def now(self) -> float:
        running = 0.0 if self._since is None else time.process_time() - self._since
        return self._done + self._idle + running

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._idle += seconds

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self._since = time.process_time()
        try:
            yield
        finally:
            self.last_s = time.process_time() - self._since
            self._done += self.last_s
            self._since = None


class MeasuredEngine(Engine):
    """The real engine, its `StepClock` running while it steps. ``after_step``, if set, is
    called with each step's CPU seconds once the clock has stopped (so what it does is not
    the engine's time): `kvpilot.sim.paired` runs calibration steps there."""

    after_step: Callable[[float], None] | None = None

    def step(
        self, *, snapshots: bool = True, idle_until: float | None = None
    ) -> list[RequestOutput]:
        clock = self.clock
        assert isinstance(clock, StepClock)
        with clock.running():
            outputs = super().step(snapshots=snapshots, idle_until=idle_until)
        if self.after_step is not None:
            self.after_step(clock.last_s)
        return outputs


class TimedExecutor:
    """A real executor that remembers the shape of its last batch (with the KV its works
    read more than once, from their block tables)."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.block_size = inner.block_size
        self.num_blocks = inner.num_blocks
        self.fingerprint = inner.fingerprint
        self.last_shape: BatchShape | None = None
        self.max_context = 0  # the longest context any step reached

    def execute(self, works: Sequence[SeqWork]) -> StepOutput:
        self.last_shape = batch_shape(works, block_size=self.block_size)
        for w in works:
            self.max_context = max(self.max_context, w.start_pos + len(w.token_ids))
        return self.inner.execute(works)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.inner.copy_blocks(pairs)

    def poison_blocks(self, blocks: Sequence[int]) -> None:
        self.inner.poison_blocks(blocks)


@dataclass(frozen=True, slots=True)
class StepSample:
    shape: BatchShape
    seconds: float


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` torch CPU threads (restored after). One thread measures steadily on a
    shared machine; more threads spin against each other under contention."""
    import torch

    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def model_limit(
    model: str | Path = "tiny", *, kv_blocks: int = 2048, config: EngineConfig = CALIBRATION_CONFIG
) -> int:
    """The longest sequence `real_engine` on ``model`` takes (its ``max_model_len``): the
    model's position limit or the pool's tokens, the smaller; read from the config alone."""
    from kvpilot.model.config import ModelConfig
    from kvpilot.model.loader import resolve_model_path

    config_limit = ModelConfig.from_folder(resolve_model_path(model)).max_position_embeddings
    return min(config_limit, kv_blocks * block_size_of(config))


def real_engine(
    model: str | Path = "tiny",
    *,
    kv_blocks: int = 2048,
    config: EngineConfig = CALIBRATION_CONFIG,
    device: str = "cpu",
    dtype: str = "float32",
) -> tuple[Engine, TimedExecutor]:
    """The real engine on ``model`` with a `TimedExecutor` around its ModelRunner."""
    from kvpilot.model.runner import ModelRunner

    runner = ModelRunner(
        model,
        num_blocks=kv_blocks,
        block_size=block_size_of(config),
        dtype=dtype,
        device=device,
        attention=config.runner.attention or "torch",
    )
    timed = TimedExecutor(runner)
    engine = MeasuredEngine(
        timed,
        config,
        tokenizer=runner.tokenizer,
        eos_token_ids=runner.eos_token_ids,
        max_model_len=runner.max_model_len,
        vocab_size=runner.config.vocab_size,
        clock=StepClock(),
    )
    return engine, timed


def warm_up(engine: Engine) -> None:
    """A first batch pays torch's one-time costs: run one, then empty the prefix cache."""
    pending = {
        engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        for prompt in ([5] * 300, [6] * 40)
    }
    while pending:
        for o in engine.step():
            if o.finished and o.request_id in pending:
                pending.discard(o.request_id)
                engine.pop_output(o.request_id)
    engine.kv.radix.evict(engine.kv.device.num_blocks)
