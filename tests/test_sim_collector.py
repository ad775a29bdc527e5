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
