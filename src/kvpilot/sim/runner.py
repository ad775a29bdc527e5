"""`SimulatedRunner`: the engine's executor on virtual time.

It computes nothing: each batch advances the `VirtualClock` by the cost model's iteration
time, and every sampled token is a deterministic function of the request's seed and the
generation step (so a preempted and recomputed sequence samples the same tokens again, as
seeded sampling would). Output lengths come from the workload (``max_tokens`` with
``ignore_eos``), never from the tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvpilot.engine.clock import VirtualClock
from kvpilot.engine.executor import SeqWork, StepOutput
from kvpilot.engine.run_protocols import TokenStream
from kvpilot.errors import ConfigError
from kvpilot.memory.hashing import ModelFingerprint
from kvpilot.sim.batch_shape import BatchShape, batch_shape, decode_run_shape, shared_kv_tokens
from kvpilot.sim.cost_model import StepCostModel

if TYPE_CHECKING:
    from kvpilot.engine.request import Sequence as Seq

_SEED_MUL, _STEP_MUL, _DRAW_MUL, _MASK = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0xFFFFFFFF
_VECTOR_MIN_TOKENS = 48  # fewer draws than this: a comprehension beats numpy's fixed cost
_STREAM_SEEDS = 4096  # seeds whose draws a runner keeps (well above any batch's sequences)
_STREAM_MAX_STEPS = 1024  # draws made at once for one seed, unless more are asked for


def _step_offsets(steps: int) -> np.ndarray:
    """``s * STEP mod 2**32`` for s = 0 .. steps-1 (uint32)."""
    return (np.arange(steps, dtype=np.uint64) * _STEP_MUL & _MASK).astype(np.uint32)


_STEP_OFFSETS = _step_offsets(4096)

# ``_new_shape(BatchShape, fields)`` is ``BatchShape(*fields)`` with every field given: the
# named tuple's ``__new__`` is Python code that calls exactly ``tuple.__new__(cls, fields)``.
_new_shape = tuple.__new__


class SimulatedRunner:
    """Implements `kvpilot.engine.executor.Executor` with a cost model and a virtual clock,
    and `kvpilot.engine.run_protocols.DecodeRunExecutor` (many decode-only steps at once).

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
        if not 2 <= vocab_size <= 2**31:
            raise ConfigError(
                f"vocab_size must be in [2, 2**31] (int32 token ids), got {vocab_size}"
            )
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
        self._last_shape = BatchShape()
        self._last_run: tuple[Sequence[int], int] | None = None  # (positions, last step)
        # Whether a step's shape needs more than the sums `execute` makes in its loop: window
        # figures, or the KV read more than once (counted only for a cost model reading it).
        self._distinct_kv = cost.reads_distinct_kv
        self._plain_shape = not cost.windows and not self._distinct_kv
        # The KV the steps of the last decode run clocked read more than once (for a cost
        # model reading distinct KV; a run is recorded right after it is clocked).
        self._run_shared_kv = 0
        self._high_water: dict[int, int] = {}
        self._streams: dict[int, TokenStream] = {}  # by seed: its draws made ahead

    @property
    def last_shape(self) -> BatchShape:
        """The shape of the last step executed (of a decode run: its last step)."""
        if self._last_run is not None:
            positions, step = self._last_run
            self._last_shape = decode_run_shape(
                positions, step, self.cost.windows, self._run_shared_kv
            )
            self._last_run = None
        return self._last_shape

    def execute(self, works: Sequence[SeqWork]) -> StepOutput:
        high = self._high_water
        vocab = self.vocab_size - 1
        out: dict[int, list[int]] = {}
        prefill = decode = kv_read = pairs = recomputed = 0
        for w in works:  # hot path: batch_shape and sampling in one pass
            c = len(w.token_ids)
            p = w.start_pos
            sid = w.seq_id
            end = p + c
            if c == 1:
                decode += 1
                pairs += end  # c * p + c * (c + 1) // 2 with c = 1
            else:
                prefill += c
                pairs += c * p + c * (c + 1) // 2
            kv_read += p
            mark = high.get(sid, 0)
            if end > mark:
                if p < mark:
                    recomputed += mark - p
                high[sid] = end
            elif p < mark:
                recomputed += c  # the whole work lies below the high-water mark
            if w.sampling is not None:
                base = (w.seed * _SEED_MUL + w.step * _STEP_MUL) & _MASK
                count = w.sample_count
                out[sid] = (
                    [1 + base % vocab]
                    if count == 1
                    else [1 + (base + j * _DRAW_MUL) % vocab for j in range(count)]
                )
        # BatchShape(len(works), prefill, decode, kv_read, pairs), its defaults spelt out
        shape = _new_shape(BatchShape, (len(works), prefill, decode, kv_read, pairs, (), (), 0))
        if not self._plain_shape:  # a cost model reading window or shared-KV figures
            shared_by = self.block_size if self._distinct_kv else None
            shape = batch_shape(works, self.cost.windows, shared_by)
        dt = self.cost.step_time_s(shape)
        self.clock.advance(dt)
        self.busy_s += dt
        self.steps += 1
        self.recomputed_tokens += recomputed
        self._last_shape = shape
        self._last_run = None
        return StepOutput(out)

    def poison_blocks(self, blocks: Sequence[int]) -> None:
        """Nothing to poison: simulated blocks hold no KV."""

    # -- uniform decode runs (kvpilot.engine.decode_run) ---------------------------------

    def decode_run_clock(
        self,
        positions: Sequence[int],
        start: float,
        until: float,
        max_steps: int,
        running: Sequence[Seq],
    ) -> tuple[list[float], list[float]]:
        """Durations and start times of successive decode-only steps of sequences at
        ``positions`` from clock time ``start`` (`StepCostModel.decode_run_clock`); the
        ``running`` sequences' block tables give the KV the run reads more than once, for a
        cost model that reads it."""
        if not self._distinct_kv:  # hot path: the roofline
            return self.cost.decode_run_clock(positions, start, until, max_steps)
        # The same at every step of the run: the tokens it decodes go to each sequence's own
        # blocks (`decode_run_shape`).
        shared = shared_kv_tokens(
            positions, [seq.traj.block_table for seq in running], self.block_size
        )
        self._run_shared_kv = shared
        return self.cost.decode_run_clock(positions, start, until, max_steps, shared)

    def decode_run_tokens(self, seed: int, first_step: int, steps: int) -> list[int]:
        """What `execute` samples for a sequence of ``seed`` at generation steps
        ``first_step .. first_step + steps - 1`` (one token each)."""
        vocab = self.vocab_size - 1
        # The draw of step s is (seed * SEED + s * STEP) & MASK: step by STEP from the first,
        # masked first so that the sums stay small integers (masking commutes with adding).
        start = (seed * _SEED_MUL + first_step * _STEP_MUL) & _MASK
        return [
            1 + (draw & _MASK) % vocab
            for draw in range(start, start + steps * _STEP_MUL, _STEP_MUL)
        ]

    def decode_run_stream(
        self, seed: int, first_step: int, steps: int, ahead: int = 0
    ) -> TokenStream:
        """`decode_run_tokens` of ``seed`` from ``first_step`` on, at least ``steps`` of them,
        as a stream that may start earlier and run further (`TokenStream`). ``ahead``: how
        many the caller may ask for from ``first_step`` in later runs (a hint).

        Draws are a pure function of (seed, step), so each seed's are drawn once, as far
        ahead as hinted (up to `_STREAM_MAX_STEPS`), and kept for the runs that follow (a
        sequence decodes in several runs): a run then only slices them. The oldest seeds
        are forgotten past `_STREAM_SEEDS` (drawn again when asked for again)."""
        streams = self._streams
        stream = streams.get(seed)
        if stream is not None:
            offset = first_step - stream.first
            if offset >= 0 and offset + steps <= len(stream.ids):
                return stream
        # max(steps, min(ahead, _STREAM_MAX_STEPS)), as conditionals: builtin calls that
        # take keywords cost more than the rest of a stream's lookup
        draws = ahead if ahead < _STREAM_MAX_STEPS else _STREAM_MAX_STEPS
        if draws < steps:
            draws = steps
        stream = TokenStream(first_step, self._draw(seed, first_step, draws))
        if len(streams) >= _STREAM_SEEDS and seed not in streams:
            del streams[next(iter(streams))]
        streams[seed] = stream
        return stream

    def _draw(self, seed: int, first_step: int, steps: int) -> array:
        """`decode_run_tokens` as int32 ids (vectorised when it pays)."""
        if steps < _VECTOR_MIN_TOKENS:
            return array("i", self.decode_run_tokens(seed, first_step, steps))
        start = (seed * _SEED_MUL + first_step * _STEP_MUL) & _MASK  # fits uint32
        offsets = _STEP_OFFSETS[:steps] if steps <= len(_STEP_OFFSETS) else _step_offsets(steps)
        # Python ints that fit the array's uint32 keep it uint32 (no scalar objects made):
        draws = offsets + start  # uint32 wraps: the masked sums, mod 2**32
        draws %= self.vocab_size - 1
        draws += 1
        return array("i", draws.tobytes())  # all below 2**31: the same bytes as int32

    def record_decode_run(
        self, running: Sequence[Seq], positions: Sequence[int], durations: Sequence[float]
    ) -> None:
        """Count a run of decode-only steps of the ``running`` sequences, at ``positions`` at
        its first step, as `execute` would have, one by one (the caller moves the clock)."""
        if len(running) != len(positions):
            raise ValueError("a decode run needs one position per sequence")
        k = len(durations)
        busy = self.busy_s
        for dt in durations:  # the same additions as `execute`, in order
            busy += dt
        self.busy_s = busy
        self.steps += k
        high = self._high_water
        for i, seq in enumerate(running):  # not zip(strict=True): a keyword call costs more
            seq_id = seq.seq_id
            p = positions[i]
            mark = high.get(seq_id, 0)
            if p < mark:
                self.recomputed_tokens += min(p + k, mark) - p
            if p + k > mark:
                high[seq_id] = p + k
        self._last_run = (positions, k - 1)  # its shape is worked out only when asked

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        dt = self.cost.copy_time_s(len(pairs))
        self.clock.advance(dt)
        self.busy_s += dt
        self.copied_blocks += len(pairs)
