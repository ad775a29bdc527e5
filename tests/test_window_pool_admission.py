"""Admission and a hybrid model's window pool: the fuller pool governs.

A small window pool beside an idle main pool (tests/window_models.py checkpoints, W = 32,
block size 8): requests wait for room in the window pool instead of being admitted and
preempted as their windows fill, and every output is what the same requests give with room
to spare.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from window_models import GREEDY, WINDOW, build_hybrid, long_prompts, window_engine

from kvpilot.engine import SamplingParams
from kvpilot.engine.admission import WindowAdmission
from kvpilot.engine.config import SchedulerConfig

from equivalence import LogitRecorder, assert_same_turns

B = 8
CHUNKED = {"max_prefill_chunk": 16, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module", params=["mistral", "qwen3"])
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hybrid(request.param, tmp_path_factory.mktemp("hybrid"))


def test_requests_wait_for_the_window_pool_and_none_is_preempted(hybrid: Path) -> None:
    batch = long_prompts(8, seed=12)
    tight = window_engine(hybrid, window_kv_blocks=16, **CHUNKED)
    recorder = LogitRecorder(tight)
    ids = [tight.add_request(p, GREEDY) for p in batch]
    seqs = [tight.requests[rid].seqs[0].seq_id for rid in ids]
    most_running = most_main = 0
    window_governed = False
    while tight.has_unfinished():
        tight.step()
        tight.check_invariants()
        most_running = max(most_running, len(tight.scheduler.running))
        most_main = max(most_main, tight.kv.device.usage)
        snap = tight.snapshot()
        assert snap.window is not None
        total = tight.kv.device.num_blocks
        main_held = (total - tight.kv.free_blocks()) / total
        assert snap.kv_held == max(main_held, snap.window.held_usage)  # the fuller pool
        window_governed |= snap.window.held_usage > main_held
    assert window_governed
    outs = [tight.pop_output(rid) for rid in ids]
    # The main pool never came near tau_high: only the window pool held work back.
    assert most_main < tight.config.scheduler.tau_high
    assert 1 < most_running < len(batch)
    assert tight.scheduler.num_preemptions == 0
    assert tight.snapshot().recomputed_tokens == 0
    got = [recorder._turn(s, o.outputs[0].token_ids) for s, o in zip(seqs, outs, strict=True)]
    roomy = window_engine(hybrid, **CHUNKED)
    assert_same_turns(got, LogitRecorder(roomy).generate(batch, GREEDY))


def test_without_the_window_bound_the_same_batch_is_preempted(hybrid: Path) -> None:
    """The sabotage the test above catches: admission that counts the main pool only."""
    batch = long_prompts(8, seed=12)
    unbounded = window_engine(hybrid, window_kv_blocks=16, **CHUNKED)
    unbounded.scheduler.window_room = None
    unbounded.generate(batch, GREEDY)
    assert unbounded.scheduler.num_preemptions > 0
    assert unbounded.snapshot().recomputed_tokens > 0


def test_a_sequence_alone_is_admitted_whatever_the_window_pool_holds(hybrid: Path) -> None:
    """With nothing running, admission never waits for the window pool (nothing would free
    it): a pool smaller than the bound still serves, one sequence at a time."""
    batch = long_prompts(3, seed=13)
    tiny = window_engine(hybrid, window_kv_blocks=9, **CHUNKED)
    outs = tiny.generate(batch, GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)


def test_the_bound_is_the_window_or_the_whole_sequence_if_shorter(hybrid: Path) -> None:
    engine = window_engine(hybrid, window_kv_blocks=64, **CHUNKED)
    assert engine.kv.window is not None
    bound = WindowAdmission(engine.kv.window, SchedulerConfig(**CHUNKED))
    assert bound.per_seq == WINDOW // B + 2
    assert bound.chunk_blocks == 16 // B + 1
    short = engine.add_request(list(range(3, 12)), SamplingParams(max_tokens=4))
    long = engine.add_request(long_prompts(1, seed=14)[0], GREEDY)
    assert bound.bound(engine.requests[short].seqs[0]) == -(-(9 + 4) // B) == 2
    assert bound.bound(engine.requests[long].seqs[0]) == WINDOW // B + 2
