"""A fixed policy that asks for a tier the engine lacks gets a drop, and says why (the one
pause action `pause_pricing.feasible` changes: the engine asks it only for offloads)."""

from __future__ import annotations

import pytest

from kvpilot.engine import Engine
from kvpilot.engine.sampling import SamplingParams
from kvpilot.policy.breakeven import PauseAction


@pytest.mark.parametrize(("policy", "tier"), [("offload-disk", "disk"), ("retain", None)])
def test_an_offload_to_a_missing_tier_drops(policy: str, tier: str | None) -> None:
    engine = Engine.from_pretrained("tiny", kv_blocks=64, max_model_len=512, pause_policy=policy)
    assert engine.offload.disk is None
    session = engine.sessions.open()
    session.generate("a prompt long enough to fill a block or two of tokens", SamplingParams(4))
    decision = session.pause(expected_wait_s=5.0)
    if tier is None:
        assert decision.action is PauseAction.RETAIN
    else:
        assert decision.action is PauseAction.DROP
        assert f"no {tier} tier is configured" in decision.reason
    assert session.last_pause is not None and session.last_pause.decision is decision
