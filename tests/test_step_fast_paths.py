"""The step and request paths' fast forms against the plain computations they replace:
the scheduler's chunk size and its works built by ``tuple.__new__``, a request's prefix hit
by tier, and the inter-token latencies `_append_token` counts inline."""

from __future__ import annotations

from array import array
from itertools import pairwise

from hypothesis import example, given
from hypothesis import strategies as st

from kvpilot.engine import Engine, EngineConfig, SamplingParams, SeqWork, VirtualClock
from kvpilot.engine.request import PromptIds, Request
from kvpilot.memory.tiers import DEVICE, DISK, HOST

from fake_executor import FakeExecutor

B = 16


class TickingExecutor(FakeExecutor):
    """A fake executor whose steps take a growing, uneven time on the engine's clock."""

    def __init__(self, num_blocks: int, clock: VirtualClock) -> None:
        super().__init__(num_blocks, B)
        self.clock = clock

    def execute(self, works):  # type: ignore[no-untyped-def]
        self.clock.advance(0.001 * (len(self.steps) % 7 + 1))
        return super().execute(works)


def make_engine(**cfg: object) -> Engine:
    clock = VirtualClock()
    config = EngineConfig.from_kwargs(block_size=B, **cfg)
    executor = TickingExecutor(256, clock)
    return Engine(executor, config, vocab_size=500, max_model_len=4096, clock=clock)


@given(st.integers(1, 5000), st.integers(-3, 5000), st.integers(1, 600), st.booleans())
@example(5, 0, 8, True)  # a spent budget still gets one token (as max(1, ...) gave)
def test_chunk_of_is_the_clamped_minimum(
    remaining: int, budget: int, chunk: int, chunked: bool
) -> None:
    engine = make_engine(max_prefill_chunk=chunk, chunked_prefill=chunked)
    want = max(1, min(remaining, chunk, budget)) if chunked else remaining
    assert engine.scheduler._chunk_of(remaining, budget) == want


@given(st.integers(0, 300), st.integers(0, 400), st.integers(0, 400))
def test_cached_by_tier_is_the_clamped_split(cached: int, host: int, disk: int) -> None:
    request = Request("r", PromptIds(array("i", [1])), SamplingParams(), 0.0, 1)
    request.cached_tokens = cached
    request.set_cached_by_tier(host, disk)
    on_host = min(host, cached)
    on_disk = min(disk, cached - on_host)
    want = {DEVICE: cached - on_host - on_disk, HOST: on_host, DISK: on_disk}
    assert request.cached_by_tier == want


def test_works_are_seqworks_with_their_fields_in_order() -> None:
    """Each scheduled work is a `SeqWork` whose named fields say what the step computes:
    the chunk of the trajectory's tokens from what is computed, the sequence's table, its
    sampling params on its last chunk only, and its output count as the step index."""
    engine = make_engine(max_prefill_chunk=32, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=3, seed=11)
    engine.add_request(list(range(1, 71)), params)
    engine.add_request(list(range(100, 110)), params)
    seen = 0
    while engine.has_unfinished():
        sched = engine.scheduler.schedule()
        for seq, work in zip(sched.seqs, sched.works, strict=True):
            assert type(work) is SeqWork
            traj = seq.traj
            start = traj.num_computed_tokens
            n = len(work.token_ids)
            last = start + n == len(traj.tokens)
            want = SeqWork(
                seq.seq_id,
                traj.tokens[start : start + n],
                start,
                traj.block_table,
                sampling=seq.request.params if last else None,
                step=len(seq.output_token_ids),
                seed=seq.seed,
            )
            assert work == want and work._asdict() == want._asdict()
            seen += 1
        result = engine.executor.execute(sched.works)
        engine._process(sched, result.tokens, engine.clock.now(), False)
    assert seen >= 6


def test_inter_token_latencies_are_the_gaps_between_a_sequences_tokens() -> None:
    """Stepping one by one, every token after a sequence's first adds the time since the
    one before it (`Engine._append_token` counts it inline) and counts as generated."""
    engine = make_engine(max_num_batched_tokens=48, max_prefill_chunk=16)
    times: dict[int, list[float]] = {}
    original = engine._append_token

    def recording(seq, token, now):  # type: ignore[no-untyped-def]
        times.setdefault(seq.seq_id, []).append(now)
        return original(seq, token, now)

    engine._append_token = recording  # type: ignore[method-assign]
    for i in range(3):
        engine.add_request([7 + i] * (20 + 9 * i), SamplingParams(max_tokens=6 + i))
    while engine.has_unfinished():
        engine.step()
    gaps = sorted(b - a for ts in times.values() for a, b in pairwise(ts))
    assert sorted(engine.stats.itl_s) == gaps
    assert len(gaps) == sum(6 + i - 1 for i in range(3))
    assert engine.stats.generated_tokens == sum(6 + i for i in range(3))
    assert len({round(g, 9) for g in gaps}) > 1  # uneven steps: a stale time would show
