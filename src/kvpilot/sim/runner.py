"""`SimulatedRunner`: the engine's executor on virtual time.

It computes nothing: each batch advances the `VirtualClock` by the cost model's iteration
time, and every sampled token is a deterministic function of the request's seed and the
generation step (so a preempted and recomputed sequence samples the same tokens again, as
seeded sampling would). Output lengths come from the workload (``max_tokens`` with
``ignore_eos``), never from the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.engine.clock import VirtualClock
from kvpilot.engine.executor import SeqWork, StepOutput
from kvpilot.errors import ConfigError
from kvpilot.memory.hashing import ModelFingerprint
from kvpilot.sim.cost_model import BatchShape, StepCostModel


class SimulatedRunner:
    """Implements `kvpilot.engine.executor.Executor` with a cost model and a virtual clock.

    Counters: ``busy_s`` (time spent in steps and copies), ``steps``, ``copied_blocks``, and
    ``recomputed_tokens``: KV positions a sequence computes a second time (after a
    preemption released them), found from each sequence's high-water mark.
    """

    def __init__(
        self,
        cost: StepCostModel,
        clock: VirtualClock,
        *,
        num_blocks: int,
        block_size: int | None = None,
        vocab_size: int = 32000,
    ) -> None:
        if num_blocks < 1:
            raise ConfigError(f"the simulated KV pool needs at least one block, got {num_blocks}")
        if vocab_size < 2:
            raise ConfigError("vocab_size must be >= 2")
        self.cost = cost
        self.clock = clock
        self.num_blocks = num_blocks
        self.block_size = block_size if block_size is not None else cost.block_size
        self.fingerprint = ModelFingerprint.of(
            f"simulated {cost.describe()}, block size {self.block_size}"
        )
        self.vocab_size = vocab_size
        self.busy_s = 0.0
        self.steps = 0
        self.copied_blocks = 0
        self.recomputed_tokens = 0
        self.last_shape = BatchShape()
        self._high_water: dict[int, int] = {}

    def execute(self, works: Sequence[SeqWork]) -> StepOutput:
        high = self._high_water
        vocab = self.vocab_size - 1
        out: dict[int, list[int]] = {}
        prefill = decode = kv_read = pairs = recomputed = 0
        for w in works:  # hot path: batch_shape and sampling in one pass
            c = len(w.token_ids)
            p = w.start_pos
            if c == 1:
                decode += 1
            else:
                prefill += c
            kv_read += p
            pairs += c * p + c * (c + 1) // 2
            end = p + c
            mark = high.get(w.seq_id, 0)
            if p < mark:
                recomputed += min(end, mark) - p
            if end > mark:
                high[w.seq_id] = end
            if w.sampling is not None:
                base = (w.seed * 0x9E3779B1 + w.step * 0x85EBCA77) & 0xFFFFFFFF
                out[w.seq_id] = [1 + (base + j * 0xC2B2AE3D) % vocab for j in range(w.sample_count)]
        shape = BatchShape(len(works), prefill, decode, kv_read, pairs)
        dt = self.cost.step_time_s(shape)
        self.clock.advance(dt)
        self.busy_s += dt
        self.steps += 1
        self.recomputed_tokens += recomputed
        self.last_shape = shape
        return StepOutput(out)

    def poison_blocks(self, blocks: Sequence[int]) -> None:
        """Nothing to poison: simulated blocks hold no KV."""

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        dt = self.cost.copy_time_s(len(pairs))
        self.clock.advance(dt)
        self.busy_s += dt
        self.copied_blocks += len(pairs)
