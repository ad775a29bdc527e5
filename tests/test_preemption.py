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

from kvpilot.engine import SamplingParams
from kvpilot.engine.request import Sequence
from kvpilot.engine.tier_mover import TierMover

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
