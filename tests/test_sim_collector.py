from __future__ import annotations

import gc

import pytest

from kvpilot.sim.collector import fewer_collections


def test_a_run_collects_less_often_and_leaves_the_collector_as_it_found_it() -> None:
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    kept = [object() for _ in range(10)]
    with fewer_collections(50_000):
        assert gc.get_threshold() == (50_000, *before[1:])
        assert gc.get_freeze_count() >= len(kept)  # what existed is frozen
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_the_collector_is_restored_when_the_run_fails() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), fewer_collections(9_000):
        raise RuntimeError("boom")
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_a_freeze_made_by_someone_else_is_left_in_place() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with fewer_collections():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_cycles_made_during_a_run_are_still_collected() -> None:
    class Node:
        def __init__(self) -> None:
            self.me = self

    with fewer_collections(1_000):
        for _ in range(5_000):
            Node()
        gc.collect(0)
        assert not any(isinstance(o, Node) for o in gc.get_objects())


def test_the_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError), fewer_collections(0):
        pass


def test_leaving_a_run_starts_no_collection_over_what_it_kept() -> None:
    """What the run made and kept goes to the oldest generation on exit: the restored young
    threshold does not set off a collection walking all of it at the next allocation."""
    started: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    with fewer_collections(50_000):
        kept = [[i] for i in range(20_000)]  # young containers, far past the default threshold
        gc.callbacks.append(count)
    try:
        assert gc.get_count()[0] < 100
        more = [[i] for i in range(500)]
        assert started == [] and len(kept) + len(more) == 20_500
        assert gc.is_tracked(kept[0]) and gc.get_freeze_count() == 0
    finally:
        gc.callbacks.remove(count)
