"""A turn that wants its prefix back from host now gets it in the same step when the copy is
short (`kvpilot.engine.tier_loader.SYNC_LOAD_MAX_S`), and outputs stay identical."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvpilot.engine.tier_loader as tier_loader
from kvpilot.engine import SamplingParams
from kvpilot.memory import Tier

from equivalence import FIRST, SECOND, settle, tiered

ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def resume_after_offload(tmp_path: Path) -> tuple[int, int, list[int]]:
    """(steps until the resumed turn's first token, loads finished in step, its output)."""
    engine = tiered("tiny", tmp_path, "offload-host")
    s = engine.open_session()
    s.generate(FIRST, ONE)
    s.pause(expected_wait_s=100.0)  # no prefetch before the early return below
    settle(engine)
    assert engine.kv.radix.cached_blocks(Tier.HOST) > 0
    engine.clock.advance(1.0)
    rid = s.submit(SECOND, ONE)
    steps = 0
    while not engine.get_output(rid).finished:
        engine.step()
        steps += 1
    out = list(engine.pop_output(rid).token_ids)
    loader = engine.offload.mover.loader
    assert loader is not None and not loader.loads
    engine.check_invariants()
    sync = loader.sync_loads
    engine.close()
    return steps, sync, out


def test_a_short_host_load_is_waited_for_in_the_step_that_wants_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps, sync, out = resume_after_offload(tmp_path / "sync")
    assert sync == 1
    monkeypatch.setattr(tier_loader, "SYNC_LOAD_MAX_S", 0.0)  # every load waits for a poll
    later, none, same = resume_after_offload(tmp_path / "async")
    assert none == 0 and later > steps
    assert same == out
