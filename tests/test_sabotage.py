"""Every equivalence check is shown to fail against the bug it guards against.

For each sabotage of tests/sabotage.py, the relevant scenario of tests/equivalence.py passes
as is (its output equals a recompute, logits and tokens) and fails under the sabotage.
The recompute is always taken outside the sabotage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpilot.engine import Engine

from equivalence import (
    FIRST,
    SECOND,
    THIRD,
    EquivalenceMismatch,
    Turn,
    assert_same_turns,
    disk_dir,
    forked_references,
    forked_turns,
    preempted_references,
    preempted_swap_turns,
    reference_turns,
    shared_prefix_references,
    shared_prefix_turns,
    tiered,
    turns_around_disk_damage,
    turns_with_pauses,
)
from sabotage import SABOTAGES


@dataclass(frozen=True, slots=True)
class Scenario:
    run: Callable[[Path, Path], list[Turn]]  # (model, tmp) -> turns
    reference: Callable[[Path], list[Turn]]


def _through(policy: str) -> Scenario:
    return Scenario(
        lambda model, tmp: turns_with_pauses(tiered(model, tmp, policy)),
        lambda model: reference_turns(model, [FIRST, SECOND, THIRD]),
    )


def _plain(
    run: Callable[[Engine], list[Turn]], reference: Callable[[Path], list[Turn]]
) -> Scenario:
    return Scenario(
        lambda model, tmp: run(Engine.from_pretrained(str(model), kv_blocks=128)), reference
    )


SCENARIOS = {
    "round trip through host": _through("offload-host"),
    "round trip through disk": _through("offload-disk"),
    "flipped bytes on disk": Scenario(
        lambda model, tmp: turns_around_disk_damage(
            tiered(model, tmp, "offload-disk"), disk_dir(tmp, "offload-disk"), "flip"
        ),
        lambda model: reference_turns(model, [FIRST, SECOND]),
    ),
    "fork": _plain(forked_turns, forked_references),
    "shared prefix": _plain(shared_prefix_turns, shared_prefix_references),
    "swap preemption": Scenario(
        lambda model, tmp: preempted_swap_turns(model), preempted_references
    ),
}

CAUGHT_BY = {
    "swap_in_skipped": "round trip through host",
    "preempted_swap_in_skipped": "swap preemption",
    "preempted_swap_out_skipped": "swap preemption",
    "disk_read_returns_another_block": "round trip through disk",
    "slot_mapping_off_by_one": "shared prefix",
    "copy_on_write_skipped": "fork",
    "checksums_disabled": "flipped bytes on disk",
    "prefix_match_one_block_long": "shared prefix",
}


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


def test_every_sabotage_has_a_scenario() -> None:
    assert set(CAUGHT_BY) == set(SABOTAGES)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_output_equals_a_recompute(name: str, model: Path, tmp_path: Path) -> None:
    scenario = SCENARIOS[name]
    assert_same_turns(scenario.run(model, tmp_path), scenario.reference(model))


@pytest.mark.parametrize("sabotage", SABOTAGES)
def test_sabotage_is_caught_by_its_equivalence_check(
    sabotage: str, model: Path, tmp_path: Path
) -> None:
    scenario = SCENARIOS[CAUGHT_BY[sabotage]]
    want = scenario.reference(model)
    with SABOTAGES[sabotage]():
        got = scenario.run(model, tmp_path)
    with pytest.raises(EquivalenceMismatch) as caught:
        assert_same_turns(got, want)
    print(f"{sabotage}: caught by {CAUGHT_BY[sabotage]!r}: {caught.value}")
