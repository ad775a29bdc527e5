"""The scheduler, engine loop and sessions, on a torch-free executor that checks every KV read."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.engine import Engine, EngineConfig, SamplingParams, VirtualClock
from kvpilot.errors import (
    InvalidRequest,
    PromptTooLong,
    SessionBusy,
    SessionNotFound,
    SessionQuotaExceeded,
)

from fake_executor import FakeExecutor, oracle_generate

B = 16


def make_engine(num_blocks: int = 256, **cfg: object) -> Engine:
    executor = FakeExecutor(num_blocks, B)
    config = EngineConfig.from_kwargs(block_size=B, **cfg)
    return Engine(executor, config, vocab_size=500, max_model_len=4096, clock=VirtualClock())


def run_checked(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(length)]


def assert_all_blocks_free(engine: Engine) -> None:
    for session in list(engine.sessions.values()):
        session.close()
    engine.kv.radix.evict(engine.kv.device.num_blocks)
    engine.check_invariants()
    assert engine.kv.device.num_free == engine.kv.device.num_blocks
    assert not engine.kv.trajectories


def test_outputs_match_oracle_for_mixed_lengths() -> None:
    engine = make_engine()
    prompts = [prompt(i, n) for i, n in enumerate([1, 5, 16, 17, 40, 100, 300])]
    params = SamplingParams(max_tokens=20)
    ids = [engine.add_request(p, params) for p in prompts]
    run_checked(engine)
    for rid, p in zip(ids, prompts, strict=True):
        assert list(engine.pop_output(rid).token_ids) == oracle_generate(p, params)
    assert_all_blocks_free(engine)


def test_chunked_and_monolithic_prefill_give_identical_outputs() -> None:
    prompts = [prompt(i, 700 + 37 * i) for i in range(4)]
    params = SamplingParams(max_tokens=8)
    chunked = make_engine(max_prefill_chunk=64, max_num_batched_tokens=128)
    mono = make_engine(chunked_prefill=False)
    a = [o.token_ids for o in chunked.generate(prompts, params)]
    b = [o.token_ids for o in mono.generate(prompts, params)]
    assert a == b
    assert max(len(w) for step in chunked.executor.steps for w in [step]) >= 1
    for step in chunked.executor.steps:
        assert sum(len(w.token_ids) for w in step) <= 128
        assert all(len(w.token_ids) <= 64 for w in step)
    assert any(len(w.token_ids) >= 700 for step in mono.executor.steps for w in step)


def test_prefix_hit_is_block_aligned_and_outputs_unchanged() -> None:
    engine = make_engine()
    p = prompt(7, 100)
    params = SamplingParams(max_tokens=5)
    cold = engine.generate([p], params)[0]
    warm = engine.generate([p], params)[0]
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == 96  # 100 tokens at B=16: six full blocks
    assert warm.token_ids == cold.token_ids
    assert engine.kv.radix.stats.hit_tokens >= 96


def test_shared_system_prompt_is_reused_across_requests() -> None:
    engine = make_engine()
    system = prompt(1, 64)
    params = SamplingParams(max_tokens=3)
    engine.generate([system + prompt(2, 10)], params)
    out = engine.generate([system + prompt(3, 10)], params)[0]
    assert out.cached_tokens == 64
    assert list(out.token_ids) == oracle_generate(system + prompt(3, 10), params)


def test_prefix_caching_off_reuses_nothing() -> None:
    engine = make_engine(enable_prefix_caching=False)
    p = prompt(7, 100)
    engine.generate([p], SamplingParams(max_tokens=2))
    assert engine.generate([p], SamplingParams(max_tokens=2))[0].cached_tokens == 0


def test_session_turn_equals_whole_history_as_one_prompt() -> None:
    engine = make_engine()
    session = engine.open_session()
    params = SamplingParams(max_tokens=7)
    history: list[int] = []
    cached = []
    for turn in range(4):
        new = prompt(100 + turn, 23 + 11 * turn)
        out = session.generate(new, params)
        history += new
        assert list(out.token_ids) == oracle_generate(history, params)
        assert out.prompt_tokens == len(history)
        cached.append(out.cached_tokens)
        history += list(out.token_ids)
        engine.check_invariants()
    assert cached[0] == 0
    assert all(b > a for a, b in itertools.pairwise(cached))
    # The session's own KV is reused: everything but the uncomputed last token.
    assert cached[-1] >= len(history) - len(prompt(103, 56)) - 7 - 1
    assert_all_blocks_free(engine)


def test_forked_sessions_match_independent_runs_and_copy_at_most_one_block() -> None:
    engine = make_engine()
    base = engine.open_session()
    params = SamplingParams(max_tokens=5)
    first = base.generate(prompt(5, 45), params)
    history = prompt(5, 45) + list(first.token_ids)
    used_before = engine.kv.device.num_used
    forks = base.fork(4)
    assert engine.kv.device.num_used - used_before <= 4  # one partial tail block each
    assert len(engine.executor.copies) <= 4
    for i, f in enumerate(forks):
        new = prompt(200 + i, 9)
        out = f.generate(new, params)
        assert list(out.token_ids) == oracle_generate(history + new, params)
        assert out.cached_tokens >= (len(history) - 1) // B * B
    assert_all_blocks_free(engine)


def test_n_branches_prefill_once_and_fork() -> None:
    engine = make_engine()
    p = prompt(9, 70)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=42, n=3)
    out = engine.generate([p], params)[0]
    assert len(out.outputs) == 3
    prefill_tokens = sum(
        len(w.token_ids) for step in engine.executor.steps for w in step if len(w.token_ids) > 1
    )
    assert prefill_tokens == 70
    for branch in out.outputs:
        solo = SamplingParams(max_tokens=6, temperature=1.0, seed=42 + branch.index)
        assert list(branch.token_ids) == oracle_generate(p, solo, seed=42 + branch.index)
    assert len({o.token_ids for o in out.outputs}) > 1
    assert_all_blocks_free(engine)


def test_preemption_by_recompute_leaves_outputs_identical_and_is_counted() -> None:
    prompts = [prompt(300 + i, 60 + 13 * i) for i in range(12)]
    params = SamplingParams(max_tokens=40)
    tight = make_engine(num_blocks=40)
    roomy = make_engine(num_blocks=1024)
    ids = [tight.add_request(p, params) for p in prompts]
    run_checked(tight)
    got = [list(tight.pop_output(r).token_ids) for r in ids]
    want = [list(o.token_ids) for o in roomy.generate(prompts, params)]
    assert got == want
    assert tight.scheduler.num_preemptions > 0
    assert roomy.scheduler.num_preemptions == 0
    assert_all_blocks_free(tight)


def test_admission_stops_at_tau_high() -> None:
    engine = make_engine(num_blocks=64, tau_high=0.5)
    for i in range(10):
        engine.add_request(prompt(i, 100), SamplingParams(max_tokens=50))
    engine.step()
    held = engine.scheduler.held_usage()
    assert engine.scheduler.waiting, "admission should have stopped"
    assert held < 0.5 + 7 / 64 + 1e-9  # the last admitted request may cross the line


def test_stop_token_ids_and_max_tokens() -> None:
    engine = make_engine()
    p = prompt(11, 30)
    full = oracle_generate(p, SamplingParams(max_tokens=10))
    stop = full[3]
    out = engine.generate([p], SamplingParams(max_tokens=10, stop_token_ids=(stop,)))[0]
    assert list(out.token_ids) == full[: full.index(stop) + 1]
    assert out.outputs[0].finish_reason == "stop"
    out = engine.generate([p], SamplingParams(max_tokens=4))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.token_ids) == 4


class LetterTokenizer:
    """Token t decodes to one letter: enough to test stop strings without a model."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_strings_cut_the_text_at_the_first_match() -> None:
    engine = make_engine()
    engine.tokenizer = LetterTokenizer()
    p = prompt(12, 30)
    full = engine.generate([p], SamplingParams(max_tokens=20))[0]
    stop = full.text[5:7]
    out = engine.generate([p], SamplingParams(max_tokens=20, stop=(stop,)))[0]
    assert out.text == full.text[: full.text.find(stop)]
    assert out.outputs[0].finish_reason == "stop"
    assert len(out.token_ids) == full.text.find(stop) + 2


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ([], InvalidRequest),
        ([1, 2, -3], InvalidRequest),
        ([1, 2, 500], InvalidRequest),
        (["a", "b"], InvalidRequest),
        ([1] * 5000, PromptTooLong),
    ],
)
def test_bad_prompts_are_rejected_and_engine_keeps_serving(bad: list, error: type) -> None:
    engine = make_engine()
    with pytest.raises(error):
        engine.add_request(bad, SamplingParams(max_tokens=2))
    p = prompt(1, 20)
    assert list(engine.generate([p], SamplingParams(max_tokens=3))[0].token_ids) == (
        oracle_generate(p, SamplingParams(max_tokens=3))
    )


def test_prompt_larger_than_kv_pool_is_rejected() -> None:
    engine = make_engine(num_blocks=4)
    with pytest.raises(PromptTooLong, match="KV pool"):
        engine.add_request(prompt(1, 100))


def test_bad_sampling_params_raise_typed_errors() -> None:
    for kwargs in [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"n": 0}, {"top_k": -2}]:
        with pytest.raises(InvalidRequest):
            SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_session_misuse_is_rejected() -> None:
    engine = make_engine()
    session = engine.open_session()
    session.submit(prompt(1, 10), SamplingParams(max_tokens=3))
    with pytest.raises(SessionBusy, match="running"):
        session.submit(prompt(2, 10))
    with pytest.raises(SessionBusy, match="fork"):
        session.fork(2)
    with pytest.raises(SessionBusy, match="rewind"):
        session.rewind(3)
    run_checked(engine)
    with pytest.raises(InvalidRequest, match="n > 1"):
        session.submit(prompt(3, 5), SamplingParams(n=2))
    assert engine.get_session(session.session_id) is session
    session.close()
    with pytest.raises(SessionNotFound, match="closed"):
        session.submit(prompt(3, 5))
    with pytest.raises(SessionNotFound, match="unknown session"):
        engine.get_session(session.session_id)
    assert_all_blocks_free(engine)


def test_session_errors_are_invalid_requests_the_server_already_maps() -> None:
    for error in (SessionNotFound, SessionBusy, SessionQuotaExceeded):
        assert issubclass(error, InvalidRequest)


def test_session_table_is_the_one_registry_of_open_sessions() -> None:
    engine = make_engine()
    a = engine.open_session(session_id="agent-a")
    b = engine.open_session()
    assert set(engine.sessions) == {"agent-a", b.session_id} and len(engine.sessions) == 2
    assert engine.sessions["agent-a"] is a and engine.sessions.get("nope") is None
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.open_session(session_id="agent-a")
    a.generate(prompt(1, 40), SamplingParams(max_tokens=3))
    (child,) = a.fork()
    assert engine.sessions[child.session_id] is child and child.turns == a.turns == 1
    assert [s.session_id for s in engine.sessions.idle()] == ["agent-a", child.session_id]
    engine.check_invariants()
    a.traj.close()  # behind the table's back: its audit notices
    with pytest.raises(AssertionError, match="closed trajectory"):
        engine.sessions.check_invariants()


def test_abort_frees_blocks() -> None:
    engine = make_engine()
    rid = engine.add_request(prompt(1, 200), SamplingParams(max_tokens=100))
    engine.step()
    engine.abort(rid)
    assert not engine.has_unfinished()
    assert engine.pop_output(rid).outputs[0].finish_reason == "abort"
    assert_all_blocks_free(engine)


def test_idle_sessions_give_way_to_running_work() -> None:
    engine = make_engine(num_blocks=24)
    sessions = [engine.open_session() for _ in range(3)]
    for i, s in enumerate(sessions):
        s.generate(prompt(i, 100), SamplingParams(max_tokens=4))
    p = prompt(99, 200)
    out = engine.generate([p], SamplingParams(max_tokens=4))[0]
    assert list(out.token_ids) == oracle_generate(p, SamplingParams(max_tokens=4))
    # The sessions still continue correctly (recomputing what was dropped).
    follow = sessions[0].generate(prompt(5, 8), SamplingParams(max_tokens=3))
    assert follow.finished
    assert_all_blocks_free(engine)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 120), min_size=1, max_size=8),
    max_tokens=st.integers(1, 30),
    num_blocks=st.integers(12, 80),
    chunk=st.sampled_from([8, 32, 512]),
    budget=st.sampled_from([16, 64, 2048]),
    caching=st.booleans(),
)
def test_any_workload_matches_oracle_under_pressure(
    lengths: list[int], max_tokens: int, num_blocks: int, chunk: int, budget: int, caching: bool
) -> None:
    engine = make_engine(
        num_blocks=num_blocks,
        max_prefill_chunk=chunk,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
    )
    prompts = [prompt(i % 3, n) for i, n in enumerate(lengths)]  # repeats share prefixes
    params = SamplingParams(max_tokens=max_tokens)
    ids = [engine.add_request(p, params) for p in prompts]
    run_checked(engine)
    for rid, p in zip(ids, prompts, strict=True):
        assert list(engine.pop_output(rid).token_ids) == oracle_generate(p, params)
    assert_all_blocks_free(engine)


def test_rewind_reuses_full_blocks_before_the_cut() -> None:
    engine = make_engine()
    session = engine.open_session()
    first = prompt(1, 70)
    out = session.generate(first, SamplingParams(max_tokens=5))
    session.rewind(60)  # the client resent the history, differing from token 60 on
    new = prompt(2, 12)
    again = session.generate(new, SamplingParams(max_tokens=5))
    assert again.cached_tokens == 48  # three full blocks before the cut
    assert list(again.token_ids) == oracle_generate(first[:60] + new, SamplingParams(max_tokens=5))
    assert len(out.token_ids) == 5
    with pytest.raises(InvalidRequest):
        session.rewind(10_000)
    assert_all_blocks_free(engine)


def test_speculative_branches_are_gated_under_pressure_and_still_correct() -> None:
    engine = make_engine(num_blocks=16, tau_high=0.5)
    p = prompt(21, 120)  # eight blocks: past tau_high once prefilled
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=3)
    out = engine.generate([p], params)[0]
    assert engine.stats.gated_forks == 2
    for branch in out.outputs:
        solo = SamplingParams(max_tokens=4, temperature=1.0, seed=3 + branch.index)
        assert list(branch.token_ids) == oracle_generate(p, solo, seed=3 + branch.index)
    assert_all_blocks_free(engine)


def test_snapshot_is_a_frozen_copy_of_the_engine_figures() -> None:
    import dataclasses

    engine = make_engine()
    before = engine.snapshot()
    engine.generate([prompt(1, 40)], SamplingParams(max_tokens=5))
    after = engine.snapshot()
    assert before.generated_tokens == 0 and before.steps == 0
    assert after.generated_tokens == 5 and after.requests_finished == 1
    assert after.prompt_tokens == 40 and after.prefill_tokens == 40
    assert after.tiers["device"].num_blocks == 256 and after.tiers["host"].num_blocks == 0
    assert after.running == after.waiting == 0 and after.kv_held == 0.0
    assert after.layout.block_size == B and after.layout.policy == "breakeven"
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.steps = 0  # type: ignore[misc]
    engine.generate([prompt(2, 40)], SamplingParams(max_tokens=5))
    assert after.generated_tokens == 5 and engine.snapshot().generated_tokens == 10


def test_a_request_output_is_an_immutable_snapshot() -> None:
    engine = make_engine()
    rid = engine.add_request(prompt(1, 40), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    early = engine.get_output(rid)
    with pytest.raises(AttributeError):
        early.finished = True  # type: ignore[misc]
    while engine.has_unfinished():
        engine.step()
    final = engine.get_output(rid)
    assert not early.finished and len(early.token_ids) == 1 and early.finish_time is None
    assert final.finished and len(final.token_ids) == 5 and final.finish_time is not None
    assert final.prompt_tokens == 40 and final.prompt_token_ids == tuple(prompt(1, 40))
    (branch,) = final.outputs  # a value: equal and hashed by its fields
    assert {branch: 1}[dataclasses.replace(branch)] == 1 and branch != early.outputs[0]


def test_finished_requests_are_freed_without_the_cyclic_collector() -> None:
    """A finished request lets go of its sequences (which refer back to it) once its output
    is filed: plain, forked, session and aborted requests are all freed by reference
    counting, and a released request still reads as finished."""
    from kvpilot.engine.request import Request

    gc.collect()
    gc.disable()
    try:
        engine = make_engine()
        outs = engine.generate([prompt(1, 40), prompt(2, 9)], SamplingParams(max_tokens=5))
        engine.generate(prompt(3, 20), SamplingParams(max_tokens=4, n=3))
        session = engine.open_session()
        session.generate(prompt(4, 30), SamplingParams(max_tokens=3))
        rid = engine.add_request(prompt(5, 30), SamplingParams(max_tokens=50))
        engine.step()
        engine.abort(rid)
        held = engine.requests.get(rid)
        live = [o for o in gc.get_objects() if type(o) is Request]
        assert held is None and live == [], live
        assert all(o.finished and o.outputs[0].token_ids for o in outs)
    finally:
        gc.enable()
    kept = engine.requests[engine.add_request(prompt(6, 10), SamplingParams(max_tokens=2))]
    run_checked(engine)
    assert kept.released and kept.finished and not kept.seqs
    with pytest.raises(AssertionError, match="only a finished request"):
        Request("r", (1,), SamplingParams(), 0.0, seed=1).release()


def test_snapshots_share_the_requests_prompt_uncopied() -> None:
    """Every snapshot of a request (one per step with snapshots on) hands out the same
    prompt tuple: a long prompt is not copied again at each generated token."""
    engine = make_engine()
    ids = prompt(7, 40)
    rid = engine.add_request(ids, SamplingParams(max_tokens=4))
    first = engine.step()[0]
    assert first.request_id == rid and first.prompt_token_ids == tuple(ids)
    later = [out for _ in range(3) for out in engine.step()]
    assert later[-1].finished
    assert all(out.prompt_token_ids is first.prompt_token_ids for out in later)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(1, 70), st.integers(1, 6)), min_size=1, max_size=8),
    st.integers(1, 12),
    st.integers(1, 40),
)
def test_a_steps_token_counts_add_up_its_scheduled_work(
    requests: list[tuple[int, int]], budget: int, chunk: int
) -> None:
    """Every step's counts are its scheduled work's: batched = all tokens, prefill = the
    chunks that do not sample or take more than one token (a one-token chunk of a longer
    prompt included), decode = the rest; each work carries its sequence's next tokens."""
    engine = make_engine(max_num_batched_tokens=budget, max_prefill_chunk=chunk)
    schedule = engine.scheduler.schedule
    seen = {"prefill": 0}

    def checked() -> Any:
        out = schedule()
        items = out.scheduled
        assert out.num_batched_tokens == sum(s.num_tokens for s in items)
        prefill = sum(s.num_tokens for s in items if s.num_tokens > 1 or not s.sample)
        assert out.num_prefill_tokens == prefill
        assert out.num_decode_tokens == out.num_batched_tokens - prefill
        ends = [w.start_pos + len(w.token_ids) for w in out.works]
        assert out.context == max(ends, default=0)
        left = budget
        for s, w in zip(items, out.works, strict=True):
            traj = s.seq.traj
            assert w.seq_id == s.seq.seq_id and w.start_pos == traj.num_computed_tokens
            assert w.token_ids == traj.tokens[w.start_pos : w.start_pos + s.num_tokens]
            # Chunks in batch order, each `_chunk_of` what is left of the budget.
            chunk = engine.scheduler._chunk_of(len(traj.tokens) - w.start_pos, left)
            assert s.num_tokens == chunk
            left -= chunk
        seen["prefill"] += prefill
        return out

    engine.scheduler.schedule = checked  # type: ignore[method-assign]
    for i, (length, max_tokens) in enumerate(requests):
        engine.add_request(prompt(i, length), SamplingParams(max_tokens=max_tokens))
    run_checked(engine)
    assert engine.stats.prefill_tokens == seen["prefill"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 6), st.integers(1, 3)), min_size=1, max_size=8
    ),
    st.integers(2, 12),
)
def test_a_step_without_snapshots_returns_exactly_the_requests_it_finished(
    requests: list[tuple[int, int, int]], budget: int
) -> None:
    """``step(snapshots=False)`` (the simulator's) returns the outputs of the requests that
    finished in that step, in the order ``step()`` snapshots them, n > 1 included."""
    full, lean = (make_engine(max_num_batched_tokens=budget) for _ in range(2))
    for engine in (full, lean):
        for i, (length, max_tokens, n) in enumerate(requests):
            engine.add_request(prompt(i, length), SamplingParams(max_tokens=max_tokens, n=n))
    while full.has_unfinished():
        want = [o.request_id for o in full.step() if o.finished]
        assert [o.request_id for o in lean.step(snapshots=False)] == want
    assert not lean.has_unfinished()


def test_a_one_token_chunk_of_a_prompt_counts_as_prefill() -> None:
    engine = make_engine(max_num_batched_tokens=3, max_prefill_chunk=8)
    for i in range(3):
        engine.add_request(prompt(i, 2), SamplingParams(max_tokens=3))
    engine.step()  # 2 + 1 of the second prompt
    assert engine.stats.prefill_tokens == 3 and engine.stats.decode_tokens == 0


def test_a_step_with_nothing_waiting_holds_nothing_back() -> None:
    """`Scheduler.schedule` skips admission when nothing waits, and must still forget the
    sequences the last step held back (the engine idles while any are held back)."""
    engine = make_engine()
    hold = {"on": True}
    engine.scheduler.defer_admission = lambda seq: hold["on"]
    running = engine.add_request(prompt(1, 40), SamplingParams(max_tokens=30))
    hold["on"] = False
    engine.step()  # admits the first request
    hold["on"] = True
    held = engine.add_request(prompt(2, 40), SamplingParams(max_tokens=4))
    engine.step()
    assert engine.scheduler.held_back and engine.scheduler.num_deferred_admissions == 1
    engine.abort(held)  # nothing waits now; the first request still runs
    engine.step()
    assert not engine.scheduler.held_back and engine.scheduler.num_deferred_admissions == 1
    assert engine.run_until_finished(running).finished
