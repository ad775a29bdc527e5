"""Pause and resume across memory tiers: every move leaves outputs identical."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvpilot.errors import InvalidRequest
from kvpilot.memory import Tier
from kvpilot.policy.breakeven import PauseAction
from kvpilot.policy.pause import POLICY_NAMES, make_pause_policy

from equivalence import (
    FIRST,
    PARAMS,
    SECOND,
    THIRD,
    assert_same_turns,
    disk_dir,
    reference_turns,
    settle,
    tiered,
    turns_around_disk_damage,
    turns_with_pauses,
)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("policy", ["offload-host", "offload-disk", "drop", "lru", "retain"])
def test_round_trip_through_each_tier_leaves_outputs_identical(
    arch: str, policy: str, hf_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    model = hf_checkpoint(arch)
    engine = tiered(model, tmp_path, policy)
    assert_same_turns(turns_with_pauses(engine), reference_turns(model, [FIRST, SECOND, THIRD]))
    moved = engine.offload.stats.bytes_moved
    if policy == "offload-host":
        assert moved["device_to_host"] > 0 and moved["host_to_device"] > 0
    if policy == "offload-disk":
        assert moved["device_to_disk"] > 0 and moved["disk_to_device"] > 0
    if policy == "drop":
        assert engine.offload.stats.recomputed_tokens > 0
    engine.close()


def test_offload_frees_device_blocks_and_resume_reports_the_tier(tmp_path: Path) -> None:
    engine = tiered("tiny", tmp_path, "offload-host")
    session = engine.open_session()
    session.generate(FIRST, PARAMS)
    held_before = engine.kv.device.num_used
    decision = session.pause(expected_wait_s=30.0)
    assert decision.action is PauseAction.OFFLOAD_HOST
    settle(engine)
    assert engine.kv.device.num_used < held_before
    assert engine.kv.radix.cached_blocks(Tier.HOST) >= len(FIRST) // 16
    out = session.generate(SECOND, PARAMS)
    assert out.cached_tokens_by_tier["host"] >= (len(FIRST) // 16) * 16 - 16
    assert out.cached_tokens == sum(out.cached_tokens_by_tier.values())
    engine.close()


def test_breakeven_retains_when_memory_is_plentiful_and_moves_under_pressure(
    tmp_path: Path,
) -> None:
    roomy = tiered("tiny", tmp_path, "breakeven", kv_blocks=512)
    s = roomy.open_session()
    s.generate(FIRST, PARAMS)
    d = s.pause(expected_wait_s=60.0)
    assert d.action is PauseAction.RETAIN and "plentiful" in d.reason
    roomy.close()

    tight = tiered("tiny", tmp_path / "t", "breakeven", kv_blocks=40)
    s = tight.open_session()
    s.generate(FIRST, PARAMS)
    for _ in range(3):  # work waiting for memory makes device memory dear
        tight.add_request(SECOND * 8, PARAMS)
    tight.scheduler.waiting[0].prefix_reused = True
    d = s.pause(expected_wait_s=60.0)
    assert d.action is not PauseAction.RETAIN, d.reason
    assert s.last_pause is not None and s.last_pause.reason == d.reason
    while tight.has_unfinished():
        tight.step()
        tight.check_invariants()
    tight.close()


# Napkin Math 0.6, worked by hand from the spec's equations: Llama-3-70B at 32,768 tokens
# holds 32,768 x 327,680 B = 10.74 GB of KV; 8 links of 64 GB/s reload it in
# 10.74 GB / 512 GB/s = 21.0 ms (42 ms out and back); recomputing it costs
# 2 x 70.6e9 x 32,768 = 4.63e15 FLOP at 0.45 x 8 x 989 TFLOP/s = 1.30 s, 62x the reload.
NAPKIN_RELOAD_S = 10.737418240e9 / 512e9
NAPKIN_RECOMPUTE_S = 2 * 70.6e9 * 32768 / (0.45 * 8 * 989e12)


@pytest.mark.parametrize(
    ("wait_s", "pressure", "action"),
    [
        (0.01, 1.0, PauseAction.RETAIN),  # shorter than the 42 ms round trip
        (0.5, 1.0, PauseAction.OFFLOAD_HOST),  # past the break-even wait of one round trip
        (45.0, 1.0, PauseAction.OFFLOAD_HOST),  # the napkin's 45 s test run
        (3600.0, 1.0, PauseAction.OFFLOAD_HOST),  # host memory is free: no need for disk
        (45.0, 0.2, PauseAction.RETAIN),  # device memory is plentiful
        (3600.0, 0.2, PauseAction.RETAIN),
    ],
)
def test_breakeven_policy_on_kvpilot_plan_inputs_gives_the_napkin_figures(
    wait_s: float, pressure: float, action: PauseAction
) -> None:
    from kvpilot.sizing.geometry import resolve_geometry
    from kvpilot.sizing.hardware import parse_node
    from kvpilot.sizing.plan import pause_inputs

    geometry, node = resolve_geometry("llama-3-70b"), parse_node("8xh100")
    inputs = pause_inputs(geometry, node, 8, 32768, wait_s, device_pressure=pressure)
    d = make_pause_policy("breakeven").decide(inputs)
    assert d.action is action, d.reason
    assert inputs.kv_bytes == pytest.approx(10.737e9, rel=1e-4)
    assert d.reload_s == pytest.approx(NAPKIN_RELOAD_S, rel=1e-6) == pytest.approx(0.021, abs=5e-4)
    assert d.round_trip_s == pytest.approx(2 * NAPKIN_RELOAD_S, rel=1e-6)
    assert (
        d.recompute_s == pytest.approx(NAPKIN_RECOMPUTE_S, rel=1e-6) == pytest.approx(1.3, abs=0.01)
    )
    assert d.reload_vs_recompute == pytest.approx(62, abs=0.5)


def test_every_policy_is_available_by_name() -> None:
    from kvpilot.sizing.geometry import resolve_geometry
    from kvpilot.sizing.hardware import parse_node
    from kvpilot.sizing.plan import pause_inputs

    inputs = pause_inputs(resolve_geometry("llama-3-8b"), parse_node("h100"), 1, 4096, 10.0)
    actions = {name: make_pause_policy(name).decide(inputs).action for name in POLICY_NAMES}
    assert actions["retain"] is PauseAction.RETAIN
    assert actions["drop"] is PauseAction.DROP
    assert actions["offload-host"] is PauseAction.OFFLOAD_HOST
    assert actions["offload-disk"] is PauseAction.OFFLOAD_DISK
    assert actions["lru"] is PauseAction.CACHE
    assert actions["ttl"] is PauseAction.RETAIN
    assert make_pause_policy("ttl", ttl_s=3).lease_s(inputs) == 3


def test_ttl_releases_the_state_after_its_lease(tmp_path: Path) -> None:
    engine = tiered("tiny", tmp_path, "ttl", pause_ttl_s=2.0)
    s = engine.open_session()
    s.generate(FIRST, PARAMS)
    s.pause(expected_wait_s=30.0)
    assert s.traj.num_computed_tokens > 0
    engine.clock.advance(2.5)
    engine.step()
    assert s.last_pause is not None and s.last_pause.state == "cached"
    assert s.traj.num_computed_tokens == 0
    engine.close()


def test_prefetch_brings_blocks_back_before_the_predicted_return(tmp_path: Path) -> None:
    engine = tiered("tiny", tmp_path, "offload-host")
    s = engine.open_session()
    s.generate(FIRST, PARAMS)
    record = None
    s.pause(expected_wait_s=10.0, tool="pytest")
    settle(engine)
    record = s.last_pause
    assert record is not None and record.prefetch_at is not None
    assert record.prefetch_at < record.expected_return
    engine.clock.advance_to(record.prefetch_at + 1e-6)
    engine.step()  # the timer fires and starts the reload
    settle(engine)
    assert record.state == "prefetched"
    engine.clock.advance_to(record.expected_return)
    s.generate(SECOND, PARAMS)
    assert engine.offload.stats.prefetch_hits == 1
    assert engine.offload.stats.prefetch_stalls == 0


def test_early_return_loads_on_demand_and_counts_a_stall(tmp_path: Path) -> None:
    engine = tiered("tiny", tmp_path, "offload-host")
    s = engine.open_session()
    s.generate(FIRST, PARAMS)
    s.pause(expected_wait_s=100.0)
    settle(engine)
    engine.clock.advance(1.0)
    s.generate(SECOND, PARAMS)
    assert engine.offload.stats.prefetch_stalls == 1
    assert engine.offload.stats.prefetch_hits == 0


def test_wait_prediction_learns_per_tool(tmp_path: Path) -> None:
    engine = tiered("tiny", tmp_path, "retain")
    s = engine.open_session()
    s.generate(FIRST, PARAMS)
    for wait in (4.0, 6.0, 5.0):
        s.pause(tool="pytest")
        engine.clock.advance(wait)
        s.generate(THIRD, PARAMS)
    s.pause(tool="pytest")
    assert s.last_pause is not None
    assert s.last_pause.inputs.expected_wait_s == 5.0
    assert "pytest" in s.last_pause.wait_source
    other = engine.open_session()
    other.generate(SECOND, PARAMS)
    other.pause(tool="browser")
    assert other.last_pause is not None and "all tools" in other.last_pause.wait_source


def test_pause_misuse_is_rejected(tmp_path: Path) -> None:
    engine = tiered("tiny", tmp_path, "breakeven")
    s = engine.open_session()
    s.submit(FIRST, PARAMS)
    with pytest.raises(InvalidRequest, match="running"):
        s.pause(5.0)
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(InvalidRequest, match="non-negative"):
        s.pause(-1.0)
    s.close()
    with pytest.raises(InvalidRequest, match="closed"):
        s.pause(1.0)


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_corrupt_disk_blocks_are_recomputed_never_served(how: str, tmp_path: Path) -> None:
    engine = tiered("tiny", tmp_path, "offload-disk")
    turns = turns_around_disk_damage(engine, disk_dir(tmp_path, "offload-disk"), how)
    assert_same_turns(turns, reference_turns("tiny", [FIRST, SECOND]))
    assert engine.offload.stats.disk_misses > 0
    assert engine.offload.disk is not None and engine.offload.disk.stats.misses > 0
    engine.close()
