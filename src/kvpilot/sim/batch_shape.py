"""What one engine iteration computes, as far as its cost goes: `BatchShape`.

The simulator's executor turns each scheduled batch into a `BatchShape` (`batch_shape`) and
asks a `kvpilot.sim.cost_model.StepCostModel` how long it takes; the calibration records the
real engine's steps as shapes too. ``attention_pairs`` counts causal (query, key) pairs: a
chunk of ``c`` tokens after ``p`` cached ones attends to ``c * p + c * (c + 1) / 2`` pairs.
A sliding-window layer group of window ``W`` reads at most ``W`` cached tokens and each query
attends to at most ``W`` keys (``window_kv_read``, ``window_pairs``). ``shared_kv_tokens`` is
the KV a step reads more than once (several sequences reading one cached prefix).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvpilot.engine.executor import SeqWork


class BatchShape(NamedTuple):
    """What one step computes, as far as its cost goes.

    A work of one token is a decode (cost-wise a one-token prefill chunk is the same);
    longer works are prefill chunks. ``kv_read_tokens`` is the cached context every work
    attends to (its ``start_pos``); ``new_tokens`` is the KV the step writes. For each
    sliding window W of the cost model (``windows``), ``window_kv_read[i]`` and
    ``window_pairs[i]`` are the same figures capped by the window. ``shared_kv_tokens`` is
    ``kv_read_tokens`` less the distinct KV read (`shared_kv_tokens`); 0 (nothing shared)
    unless the cost model reads it (``reads_distinct_kv``).

    A named tuple, not a frozen dataclass: the simulated runner builds one per step, and a
    frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``.
    """

    num_seqs: int = 0
    prefill_tokens: int = 0
    decode_seqs: int = 0
    kv_read_tokens: int = 0
    attention_pairs: int = 0
    window_kv_read: tuple[int, ...] = ()
    window_pairs: tuple[int, ...] = ()
    shared_kv_tokens: int = 0

    @property
    def new_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    @property
    def distinct_kv_tokens(self) -> int:
        """KV tokens read, each cached slot counted once however many works read it."""
        return self.kv_read_tokens - self.shared_kv_tokens

    def features(self) -> tuple[float, ...]:
        """The regressors of `CalibratedCostModel`, in `PROFILE_FEATURES` order."""
        return (
            1.0,
            float(self.prefill_tokens),
            float(self.decode_seqs),
            float(self.kv_read_tokens),
            float(self.attention_pairs),
            float(self.kv_read_tokens - self.shared_kv_tokens),
        )


def window_pairs(c: int, p: int, window: int) -> int:
    """Causal (query, key) pairs of a ``c``-token chunk after ``p`` cached tokens when each
    query sees at most ``window`` keys (itself included): sum of min(q + 1, W), q = p..p+c-1."""
    lo, hi = p + 1, p + c  # keys seen by the first and the last query, uncapped
    if hi <= window:
        return (lo + hi) * c // 2
    if lo >= window:
        return window * c
    return (lo + window) * (window - lo + 1) // 2 + window * (hi - window)


def shared_kv_tokens(
    starts: Iterable[int], tables: Iterable[Sequence[int]], block_size: int
) -> int:
    """KV tokens a step reads more than once: the total read less the distinct KV read.

    A work at ``start`` reads the first ``start`` slots of its ``table``'s blocks: every slot
    of the first ``start // block_size`` blocks and the first ``start % block_size`` of the
    next. The distinct KV is the union of those slots over the works, each block counted once
    (a block read whole by one work and in part by another counts whole)::

        work a:  [ 7 ][ 9 ][ 4:3/16 ]        start 35 = 2 * 16 + 3
        work b:  [ 7 ][ 9 ][ 2 ][ 5:1/16 ]   start 49 = 3 * 16 + 1
        read 84, distinct 16 * 3 + 3 + 1 = 52 (blocks 7, 9, 2 whole; 4 and 5 in part), shared 32
    """
    whole: set[int] = set()
    part: dict[int, int] = {}
    read = 0
    for start, table in zip(starts, tables, strict=True):
        read += start
        n_whole, tail = divmod(start, block_size)
        whole.update(table[:n_whole])
        if tail:
            block = table[n_whole]
            if part.get(block, 0) < tail:
                part[block] = tail
    distinct = block_size * len(whole)
    for block, tail in part.items():
        if block not in whole:
            distinct += tail
    return read - distinct


def batch_shape(
    works: Sequence[SeqWork], windows: Sequence[int] = (), block_size: int | None = None
) -> BatchShape:
    """The shape of a step of ``works``; with ``block_size``, its ``shared_kv_tokens`` too
    (from the works' block tables)."""
    prefill = decode = kv_read = pairs = 0
    w_read = [0] * len(windows)
    w_pairs = [0] * len(windows)
    for w in works:  # hot path
        c = len(w.token_ids)
        p = w.start_pos
        if c == 1:
            decode += 1
        else:
            prefill += c
        kv_read += p
        pairs += c * p + c * (c + 1) // 2
        for i, size in enumerate(windows):
            w_read[i] += min(p, size)
            w_pairs[i] += window_pairs(c, p, size)
    shared = 0
    if block_size is not None:
        shared = shared_kv_tokens(
            [w.start_pos for w in works], [w.block_table for w in works], block_size
        )
    return BatchShape(
        len(works), prefill, decode, kv_read, pairs, tuple(w_read), tuple(w_pairs), shared
    )


def shape_of(
    *, prefill_tokens: int = 0, decode_seqs: int = 0, context_tokens: int = 0
) -> BatchShape:
    """A batch of one prefill chunk after ``context_tokens`` cached ones plus ``decode_seqs``
    decodes, each at ``context_tokens`` of context (napkin-math shapes)."""
    c, p = prefill_tokens, context_tokens
    seqs = decode_seqs + (1 if c else 0)
    kv_read = p * seqs
    pairs = (c * p + c * (c + 1) // 2) + decode_seqs * (p + 1)
    return BatchShape(seqs, c, decode_seqs, kv_read, pairs)


def decode_run_shape(
    positions: Sequence[int], step: int, windows: Sequence[int] = (), shared: int = 0
) -> BatchShape:
    """The shape of step ``step`` of a decode-only run of sequences at ``positions`` (their
    ``start_pos`` at step 0) that read ``shared`` KV tokens more than once at step 0: what
    `batch_shape` gives for that step's works. The shared KV stays the same over the run:
    the tokens a run decodes go to each sequence's own blocks (the engine never writes into
    a block another sequence reads). A commit could still swap a block just filled for an
    identical cached one, but only if another sequence had decoded the same tokens after
    the same prefix: sampled tokens follow each request's own seed, so it does not arise."""
    n = len(positions)
    kv_read = sum(positions) + n * step
    return BatchShape(
        n,
        0,
        n,
        kv_read,
        kv_read + n,
        tuple(sum(min(p + step, size) for p in positions) for size in windows),
        tuple(sum(min(p + step + 1, size) for p in positions) for size in windows),
        shared,
    )
