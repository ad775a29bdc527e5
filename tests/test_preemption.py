"""Preemption that keeps what it can: swap to host when reloading beats recomputing, victims
chosen by what they cost to bring back; outputs identical to runs without preemption.

The equivalence of a swapping run with solo runs on the built-in tiny model, and the
sabotages it catches (the copy out or the copy back skipped), are in tests/test_sabotage.py
("swap preemption")."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_engine_core import make_engine, prompt, run_checked

from kvpilot.engine import EngineConfig, SamplingParams
from kvpilot.engine.request import Sequence
from kvpilot.engine.tier_mover import TierMover
from kvpilot.errors import ConfigError

from equivalence import assert_same_turns, preempted_references, preemption_run
from fake_executor import oracle_generate


def test_swaps_are_counted_apart_from_recompute_preemptions(tiny_model_dir: Path) -> None:
    turns, snap = preemption_run(tiny_model_dir)
    assert snap.preemptions_swapped > 0
    assert snap.preemptions >= snap.preemptions_swapped
    assert snap.bytes_moved["device_to_host"] > 0 and snap.bytes_moved["host_to_device"] > 0
    # What a swap cannot keep is each victim's partial tail block: under a block each.
    assert snap.recomputed_tokens < snap.preemptions * snap.layout.block_size

    plain_turns, plain = preemption_run(tiny_model_dir, host_kv_blocks=0)
    assert plain.preemptions > 0 and plain.preemptions_swapped == 0
    assert plain.bytes_moved["device_to_host"] == 0
    assert_same_turns(turns, plain_turns)


def test_recompute_is_kept_when_the_rule_says_it_is_cheaper(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link so slow that reloading loses to recomputing: no swap; outputs still identical."""
    monkeypatch.setattr(TierMover, "device_link_bw", lambda self: 1.0)  # 1 byte/s
    turns, snap = preemption_run(tiny_model_dir)
    assert snap.preemptions > 0 and snap.preemptions_swapped == 0
    assert snap.bytes_moved["device_to_host"] == 0
    assert_same_turns(turns, preempted_references(tiny_model_dir))


def test_swapping_run_equals_solo_runs_on_a_gqa_checkpoint(
    hf_checkpoint: Callable[[str], Path],
) -> None:
    model = hf_checkpoint("qwen3")
    turns, snap = preemption_run(model)
    assert snap.preemptions_swapped > 0
    assert_same_turns(turns, preempted_references(model))


def test_victim_is_the_cheapest_to_bring_back_among_later_admissions() -> None:
    """With a price hook, the victim is the cheapest of the sequences admitted after the one
    that needs blocks (here: the earliest of them), not simply the latest."""
    prompts = [prompt(300 + i, 60 + 13 * i) for i in range(12)]
    params = SamplingParams(max_tokens=40)
    engine = make_engine(num_blocks=40)
    scheduler = engine.scheduler
    asked: list[Sequence] = []
    rounds: list[tuple[Sequence, list[Sequence]]] = []

    def cost(seq: Sequence) -> float:
        asked.append(seq)
        return float(seq.seq_id)

    preempt = scheduler._preempt

    def recording_preempt(seq: Sequence) -> None:
        rounds.append((seq, list(asked)))
        asked.clear()
        preempt(seq)

    scheduler.preempt_cost = cost
    scheduler._preempt = recording_preempt  # type: ignore[method-assign]
    ids = [engine.add_request(p, params) for p in prompts]
    run_checked(engine)
    for rid, p in zip(ids, prompts, strict=True):
        assert list(engine.pop_output(rid).token_ids) == oracle_generate(p, params)
    priced = [(victim, candidates) for victim, candidates in rounds if candidates]
    assert priced, "no preemption had a choice of victims"
    for victim, candidates in priced:
        assert victim is min(candidates, key=lambda s: s.seq_id)
    assert any(len(c) > 1 for _, c in priced), "never more than one candidate"


def hot_state_run(max_defer_s: float, returns: bool = True) -> tuple[int, float, bool]:
    """A session pauses (retained, back in 10 ms) holding most of a small pool; a request
    that needs some of its blocks arrives. Returns the session's cached tokens on its next
    turn (if it returns), when the request was first scheduled, and whether it was right."""
    engine = make_engine(num_blocks=20, max_defer_s=max_defer_s)
    session = engine.open_session()
    params = SamplingParams(max_tokens=4)
    session.generate(prompt(1, 200), params)
    assert session.pause(expected_wait_s=0.01).action.value == "retain"
    other = prompt(2, 150)
    rid = engine.add_request(other, params)
    start = engine.clock.now()
    cached = 0
    if returns:
        engine.step()
        cached = engine.run_until_finished(session.submit(prompt(3, 10), params)).cached_tokens
    out = engine.run_until_finished(rid)
    seq = engine.requests[rid].seqs[0] if rid in engine.requests else None
    first = seq.first_token_time if seq is not None else None
    engine.check_invariants()
    deferred = engine.snapshot().admissions_deferred
    assert deferred == (1 if max_defer_s else 0)
    waited = (first if first is not None else engine.clock.now()) - start
    return cached, waited, list(out.token_ids) == oracle_generate(other, params)


def test_admission_waits_for_retained_state_that_is_back_soon() -> None:
    """The request that would evict a retained session's tail waits for the session's next
    turn, which then finds its whole history cached; without the guard it does not."""
    kept, _, right = hot_state_run(max_defer_s=1.0)
    assert right and kept == 200 + 4 - 1  # all but the last sampled token (never fed back)
    lost, _, right = hot_state_run(max_defer_s=0.0)
    assert right and lost < kept


def test_a_held_back_request_waits_at_most_max_defer_s() -> None:
    """The session never returns. The request goes in once it has waited max_defer_s, or
    sooner once the overdue session is expected back later than a recompute would take
    (here after about 24 ms: 48 tokens at the default 2,000 tokens/s)."""
    _, waited, right = hot_state_run(max_defer_s=0.015, returns=False)
    assert right and 0.015 <= waited < 0.018
    _, waited, right = hot_state_run(max_defer_s=1.0, returns=False)
    assert right and 0.02 <= waited < 0.03


def test_a_request_that_fits_is_never_held_back() -> None:
    """A retained paused session does not hold back a request that fits beside it: the guard
    asks how many blocks it lacks before anything else (`HotStateGuard.defer`)."""
    engine = make_engine(num_blocks=20, max_defer_s=1.0)
    session = engine.open_session()
    params = SamplingParams(max_tokens=4)
    session.generate(prompt(1, 100), params)
    assert session.pause(expected_wait_s=0.01).action.value == "retain"
    small = prompt(2, 40)
    rid = engine.add_request(small, params)
    engine.step()
    assert engine.requests[rid].seqs[0].status.value == "running"
    assert list(engine.run_until_finished(rid).token_ids) == oracle_generate(small, params)
    assert engine.snapshot().admissions_deferred == 0


def test_a_request_with_a_resident_prefix_is_admitted_before_one_without() -> None:
    """Longest resident prefix first: the second request, whose prefix is cached, goes ahead
    of the first (nothing cached), ties stay in arrival order; both outputs are right."""
    engine = make_engine(num_blocks=64)
    params = SamplingParams(max_tokens=2)
    cached = prompt(7, 160)
    engine.generate([cached], params)  # its blocks stay in the prefix cache
    cold = [prompt(8, 100), prompt(9, 100)]
    warm = [*cached, *prompt(10, 20)]
    ids = [engine.add_request(p, params) for p in (cold[0], warm, cold[1])]
    order = [s.request.request_id for s in engine.scheduler.waiting]
    assert order == [ids[1], ids[0], ids[2]]
    engine.check_invariants()
    run_checked(engine)
    for rid, p in zip(ids, (cold[0], warm, cold[1]), strict=True):
        assert list(engine.pop_output(rid).token_ids) == oracle_generate(p, params)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_max_defer_s_must_be_a_finite_non_negative_number(bad: float) -> None:
    with pytest.raises(ConfigError, match="max_defer_s"):
        EngineConfig.from_kwargs(max_defer_s=bad)
