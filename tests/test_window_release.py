"""Sliding-window block release on hybrid checkpoints: identical to transformers, and
identical across every cache decision, while the window group holds only the last window.

Checkpoints (tests/window_models.py): Mistral-style (every layer windowed) and Qwen3-style
mixed layers, W = 32, block size 8, contexts four to six windows long. Freed blocks are
poisoned (NaN) by the suite, the window group's included, so a read of a released block
would show in the logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from window_models import (
    GREEDY,
    WINDOW,
    assert_matches_transformers,
    build_hybrid,
    held_window_blocks,
    long_prompts,
    window_engine,
)

from kvpilot.engine import Engine, SamplingParams
from kvpilot.engine.session import Session
from kvpilot.memory.window import max_held_blocks
from kvpilot.model.runner import ModelRunner

from equivalence import LogitRecorder, Turn, assert_same_turns

B = 8


@pytest.fixture(scope="module", params=["mistral", "qwen3"])
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hybrid(request.param, tmp_path_factory.mktemp("hybrid"))


def generate(engine_options: dict[str, object], path: Path, batch: list[list[int]]) -> list[Turn]:
    return LogitRecorder(window_engine(path, **engine_options)).generate(batch, GREEDY)


@pytest.mark.parametrize(
    "options",
    [
        {"max_prefill_chunk": 24, "max_num_batched_tokens": 64},
        {"max_prefill_chunk": 24, "max_num_batched_tokens": 64, "attention": "torch"},
        {"chunked_prefill": False},
    ],
    ids=["chunked", "chunked-torch-backend", "monolithic"],
)
def test_identical_to_transformers(hybrid: Path, options: dict[str, object]) -> None:
    batch = long_prompts(3, seed=1)
    engine = window_engine(hybrid, **options)
    recorder = LogitRecorder(engine)
    peak = 0
    ids = [engine.add_request(p, GREEDY) for p in batch]
    seqs = [engine.requests[rid].seqs[0].seq_id for rid in ids]
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()  # the window group's invariants among them
        for seq in engine.scheduler.running:
            assert seq.traj.window is not None
            table = seq.traj.window
            computed = -(-seq.traj.num_computed_tokens // B)
            peak = max(peak, computed - table.lo)
    outs = [engine.pop_output(rid) for rid in ids]
    for prompt, seq_id, out in zip(batch, seqs, outs, strict=True):
        turn = recorder._turn(seq_id, out.token_ids)
        assert_matches_transformers(hybrid, prompt, turn.tokens, turn.logits)
    assert 0 < peak <= max_held_blocks(WINDOW, B)


def test_blocks_outside_the_window_are_released(hybrid: Path) -> None:
    """Held window blocks stay within ceil(W/B)+1 per sequence; without release, every block
    of the context is held in the one pool."""
    prompt = long_prompts(1, seed=2, lo=6 * WINDOW, hi=6 * WINDOW)[0]
    chunk = {"max_prefill_chunk": 32, "max_num_batched_tokens": 32}
    released = window_engine(hybrid, **chunk)
    kept = window_engine(hybrid, release_window_blocks=False, **chunk)
    assert kept.kv.window is None
    rid = released.add_request(prompt, GREEDY)
    kid = kept.add_request(prompt, GREEDY)
    peak_released = peak_kept = 0
    while released.has_unfinished() or kept.has_unfinished():
        for engine in (released, kept):
            if engine.has_unfinished():
                engine.step()
        peak_released = max(peak_released, held_window_blocks(released))
        peak_kept = max(peak_kept, kept.kv.device.num_used)
    assert released.pop_output(rid).token_ids == kept.pop_output(kid).token_ids
    context_blocks = -(-(len(prompt) + GREEDY.max_tokens) // B)
    assert peak_kept >= context_blocks - 1
    # At most the last window plus one chunk's blocks, while the chunk is computed.
    assert peak_released <= max_held_blocks(WINDOW, B) + 32 // B
    assert held_window_blocks(released) == 0  # finished: what is left is evictable cache
    window = released.kv.window
    assert window is not None
    assert window.evictable_blocks() >= context_blocks - max_held_blocks(WINDOW, B) - 1


def checked_turn(
    engine: Engine,
    session: Session,
    recorder: LogitRecorder,
    model: Path,
    history: list[int],
    new: list[int],
) -> tuple[int, list[int]]:
    """Run one session turn of ``new`` tokens, append them to ``history`` and check the
    output against transformers on the whole history; the turn's cached prompt tokens and
    its output."""
    rid = session.submit(new, GREEDY)
    request = engine.requests[rid]
    got = recorder.finish(rid)
    engine.check_invariants()
    history += new
    assert_matches_transformers(model, history, got.tokens, got.logits)
    return request.cached_tokens, list(got.tokens)


def test_session_turns_and_stateless_history_reuse_the_prefix(hybrid: Path) -> None:
    engine = window_engine(hybrid)
    session = engine.open_session()
    recorder = LogitRecorder(engine)
    history: list[int] = []
    for turn, new in enumerate(long_prompts(3, seed=3, lo=WINDOW, hi=2 * WINDOW)):
        cached, tokens = checked_turn(engine, session, recorder, hybrid, history, new)
        if turn:
            assert cached == len(history) - len(new) - 1
        history += tokens
    session.close()
    # A stateless client resends the whole history: the prefix cache (full group: radix;
    # window group: the last window's blocks, published when the session closed) serves it.
    follow = history + long_prompts(1, seed=4, lo=10, hi=10)[0]
    rid = engine.add_request(follow, GREEDY)
    request = engine.requests[rid]
    got = recorder.finish(rid)
    assert request.cached_tokens == (len(history) - 1) // B * B  # all but the partial tail
    assert_matches_transformers(hybrid, follow, got.tokens, got.logits)


def test_forks_share_window_blocks(hybrid: Path) -> None:
    engine = window_engine(hybrid)
    base = engine.open_session()
    first = long_prompts(1, seed=5, lo=4 * WINDOW + 5, hi=4 * WINDOW + 5)[0]
    out = base.generate(first, GREEDY)
    history = first + list(out.token_ids)
    branches = base.fork(2)
    window = engine.kv.window
    assert window is not None
    shared = [b for b in base.traj.window.blocks if b] if base.traj.window else []
    assert shared and all(window.pool.refcount(b) >= 3 for b in shared[:-1])
    recorder = LogitRecorder(engine)
    for branch, suffix in zip(branches, long_prompts(2, seed=6, lo=4, hi=9), strict=True):
        got = recorder.finish(branch.submit(suffix, GREEDY))
        engine.check_invariants()
        assert_matches_transformers(hybrid, history + suffix, got.tokens, got.logits)


def test_preempted_and_recomputed_identical(hybrid: Path) -> None:
    batch = long_prompts(4, seed=7)
    chunked = {"max_prefill_chunk": 32, "max_num_batched_tokens": 128}
    tight = window_engine(hybrid, kv_blocks=40, **chunked)
    roomy = window_engine(hybrid, kv_blocks=512, **chunked)
    got = LogitRecorder(tight).generate(batch, GREEDY)
    assert tight.scheduler.num_preemptions > 0
    assert_same_turns(got, LogitRecorder(roomy).generate(batch, GREEDY))
    for prompt, turn in zip(batch[:1], got, strict=False):
        assert_matches_transformers(hybrid, prompt, turn.tokens, turn.logits)


@pytest.mark.parametrize("policy", ["offload-host", "offload-disk"])
def test_pause_offload_and_reload(hybrid: Path, policy: str, tmp_path: Path) -> None:
    """A session pausing to host or disk between turns: its full-group blocks go there and
    come back; its window group's last window stays on the device, cached, and is reused.
    (Every layer windowed: nothing would move, so such a model keeps one pool with tiers.)"""
    engine = window_engine(
        hybrid,
        host_kv_blocks=256,
        pause_policy=policy,
        disk_dir=str(tmp_path / "disk"),
        disk_kv_blocks=64,
    )
    if hybrid.name.startswith("mistral"):
        assert engine.kv.window is None
        return
    assert engine.kv.window is not None
    recorder = LogitRecorder(engine)
    session = engine.open_session()
    history: list[int] = []
    for turn, new in enumerate(long_prompts(3, seed=8, lo=WINDOW, hi=2 * WINDOW)):
        cached, tokens = checked_turn(engine, session, recorder, hybrid, history, new)
        if turn:
            assert cached > 0, "the reloaded prefix was not reused"
        history += tokens
        session.pause(expected_wait_s=30.0, tool="pytest")
        while engine.offload.busy():
            engine.step()
            engine.check_invariants()
        assert not session.traj.block_table  # the device copy went to host
    moved = engine.offload.stats.bytes_moved
    tier = "host" if policy == "offload-host" else "disk"
    assert moved[f"device_to_{tier}"] > 0 and moved[f"{tier}_to_device"] > 0


def test_hit_without_its_window_recomputes_from_where_it_is_whole(hybrid: Path) -> None:
    """A small window pool evicts cached window blocks that the full group still has: a hit
    on that prefix is cut back to where the window group's KV is whole, and recomputed."""
    chunked = {"max_prefill_chunk": 32, "max_num_batched_tokens": 32}
    engine = window_engine(hybrid, window_kv_blocks=16, **chunked)
    first, other = long_prompts(2, seed=9, lo=5 * WINDOW, hi=5 * WINDOW)
    recorder = LogitRecorder(engine)
    recorder.generate([first], GREEDY)
    recorder.generate([other], GREEDY)  # its blocks evict the first prompt's window cache
    window = engine.kv.window
    assert window is not None and window.evictions > 0
    assert engine.kv.radix.match(first, None, record=False).num_tokens >= len(first) - B
    follow = [*first, 7, 8, 9]
    rid = engine.add_request(follow, GREEDY)
    request = engine.requests[rid]
    got = recorder.finish(rid)
    engine.check_invariants()
    assert request.cached_tokens < len(first) - B  # cut back: the last window was evicted
    assert_matches_transformers(hybrid, follow, got.tokens, got.logits)


def test_n_branches_fork_in_both_groups(hybrid: Path) -> None:
    """n > 1: one prefill, then forks whose partial tail is copied in both layer groups."""
    prompt = long_prompts(1, seed=10, lo=4 * WINDOW + 3, hi=4 * WINDOW + 3)[0]
    engine = window_engine(hybrid)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=5, n=3, ignore_eos=True)
    out = engine.generate([prompt], params)[0]
    assert engine.stats.prefill_tokens == len(prompt) and engine.stats.fork_copied_blocks
    for branch in out.outputs:
        solo = window_engine(hybrid)
        single = SamplingParams(
            max_tokens=8, temperature=0.8, seed=5 + branch.index, ignore_eos=True
        )
        want = solo.generate([prompt], single)[0].outputs[0].token_ids
        assert list(branch.token_ids) == list(want)


def test_pools_sized_from_memory_give_the_full_group_the_rest(hybrid: Path) -> None:
    """Sized from a memory budget, the window pool holds a full batch's windows (of no more
    sequences than the budget holds at the model's longest context, layer by layer) and the
    main pool gets the rest: more blocks than one pool of every layer, within the budget."""
    budget = 4 << 20
    options = {"kv_memory_bytes": budget, "max_num_seqs": 4, "max_num_batched_tokens": 64}
    one_pool = Engine.from_pretrained(str(hybrid), release_window_blocks=False, **options)
    split = Engine.from_pretrained(str(hybrid), **options)
    window = split.kv.window
    assert window is not None
    runner = split.executor
    assert isinstance(runner, ModelRunner) and runner.window is not None
    per_seq = -(-WINDOW // 16) + 2  # the default block size is 16
    main_bytes = runner.kv_cache.bytes_per_block if runner.window.layers.num_full else 0
    longest = 2048 // 16  # the checkpoints' max_position_embeddings
    at_longest = budget // (longest * main_bytes + per_seq * runner.window.cache.bytes_per_block)
    seqs = min(4, at_longest)
    assert seqs == (4 if main_bytes == 0 else 3)  # 4 MiB holds three 2,048-token sequences
    assert window.pool.num_blocks == seqs * per_seq + 64 // 16 + 1
    assert split.kv.device.num_blocks > one_pool.kv.device.num_blocks
    used = split.kv.device.num_blocks * runner.kv_cache.bytes_per_block
    used += window.pool.num_blocks * runner.window.cache.bytes_per_block
    assert used <= budget
    prompt = long_prompts(1, seed=11)[0]
    turn = LogitRecorder(split).generate([prompt], GREEDY)[0]
    assert_matches_transformers(hybrid, prompt, turn.tokens, turn.logits)


def test_short_window_pool_preempts_and_stays_identical(hybrid: Path) -> None:
    """The window pool, not the main one, runs out (admission is let through unbounded here;
    tests/test_window_pool_admission.py has it bounded): the scheduler preempts as for the
    main pool (an allocation needs both), and outputs do not change."""
    batch = long_prompts(4, seed=12)
    chunked = {"max_prefill_chunk": 16, "max_num_batched_tokens": 64}
    tight = window_engine(hybrid, window_kv_blocks=20, **chunked)
    tight.scheduler.window_room = None
    got = LogitRecorder(tight).generate(batch, GREEDY)
    assert tight.scheduler.num_preemptions > 0
    roomy = window_engine(hybrid, **chunked)
    assert_same_turns(got, LogitRecorder(roomy).generate(batch, GREEDY))
