"""Pause and resume across memory tiers: every move leaves outputs identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpilot.engine import Engine, SamplingParams, VirtualClock
from kvpilot.errors import InvalidRequest
from kvpilot.memory import Tier
from kvpilot.policy.breakeven import PauseAction, decide_pause
from kvpilot.policy.pause import POLICY_NAMES, make_pause_policy

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
FIRST = [(7 * i + 3) % 240 + 5 for i in range(150)]
SECOND = [(11 * i + 1) % 240 + 5 for i in range(20)]
THIRD = [(13 * i + 2) % 240 + 5 for i in range(9)]


def tiered(model: Path | str, tmp: Path, policy: str, **kw: object) -> Engine:
    options: dict[str, object] = {
        "kv_blocks": 128,
        "host_kv_blocks": 128,
        "disk_dir": str(tmp / f"disk-{policy}"),
        "pause_policy": policy,
    }
    options.update(kw)
    return Engine.from_pretrained(str(model), clock=VirtualClock(), **options)


def settle(engine: Engine) -> None:
    """Let background copies finish (the step loop polls them)."""
    while engine.offload.busy():
        engine.step()
        engine.check_invariants()


def reference(model: Path | str) -> list[list[int]]:
    engine = Engine.from_pretrained(str(model), kv_blocks=128)
    session = engine.open_session()
    return [list(session.generate(p, PARAMS).token_ids) for p in (FIRST, SECOND, THIRD)]


def three_turns_with_pauses(engine: Engine, wait_s: float = 30.0) -> list[list[int]]:
    session = engine.open_session()
    outs = []
    for prompt in (FIRST, SECOND, THIRD):
        outs.append(list(session.generate(prompt, PARAMS).token_ids))
        engine.check_invariants()
        session.pause(expected_wait_s=wait_s, tool="pytest")
        settle(engine)
    session.close()
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("policy", ["offload-host", "offload-disk", "drop", "lru", "retain"])
def test_round_trip_through_each_tier_leaves_outputs_identical(
    arch: str, policy: str, hf_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    model = hf_checkpoint(arch)
    engine = tiered(model, tmp_path, policy)
    assert three_turns_with_pauses(engine) == reference(model)
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


def test_breakeven_matches_kvpilot_plan_for_the_same_inputs() -> None:
    from kvpilot.sizing.geometry import resolve_geometry
    from kvpilot.sizing.hardware import parse_node
    from kvpilot.sizing.plan import pause_inputs

    node = parse_node("8xh100")
    geometry = resolve_geometry("llama-3-70b")
    for wait in (0.01, 0.5, 45.0, 3600.0):
        for pressure in (0.2, 1.0):
            inputs = pause_inputs(geometry, node, 8, 32768, wait, device_pressure=pressure)
            assert make_pause_policy("breakeven").decide(inputs) == decide_pause(inputs)
    inputs = pause_inputs(geometry, node, 8, 32768, 45.0)
    assert make_pause_policy("breakeven").decide(inputs).action is PauseAction.OFFLOAD_HOST


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


def corrupt(disk: Path, how: str) -> None:
    data = disk / "blocks.dat"
    if how == "flip":
        raw = bytearray(data.read_bytes())
        for i in range(0, len(raw), 4096):
            raw[i] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif how == "truncate":
        with data.open("r+b") as f:
            f.truncate(min(os.path.getsize(data), 100_000))  # cuts inside the second block
    else:
        data.unlink()


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_corrupt_disk_blocks_are_recomputed_never_served(how: str, tmp_path: Path) -> None:
    engine = tiered("tiny", tmp_path, "offload-disk")
    s = engine.open_session()
    first = list(s.generate(FIRST, PARAMS).token_ids)
    s.pause(expected_wait_s=30.0)
    settle(engine)
    corrupt(tmp_path / "disk-offload-disk", how)
    second = list(s.generate(SECOND, PARAMS).token_ids)
    assert [first, second] == reference("tiny")[:2]
    assert engine.offload.stats.disk_misses > 0
    assert engine.offload.disk is not None and engine.offload.disk.stats.misses > 0
    engine.close()


RESTART = textwrap.dedent(
    """
    import json, os, sys
    from kvpilot.engine import Engine, SamplingParams
    phase, disk = sys.argv[1], sys.argv[2]
    first, second = json.loads(sys.argv[3]), json.loads(sys.argv[4])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine = Engine.from_pretrained(
        "tiny", kv_blocks=128, disk_dir=disk, pause_policy="offload-disk"
    )
    if phase == "before":
        s = engine.open_session(session_id="agent-1")
        out = s.generate(first, params)
        s.pause(expected_wait_s=600.0, tool="human-review")
        while engine.offload.busy():
            engine.step()
        engine.offload.disk.flush()
        print(json.dumps(list(out.token_ids)), flush=True)
        os._exit(0)  # killed: no clean shutdown
    s = engine.open_session(session_id="agent-1")
    before = engine.stats.prefill_tokens
    out = s.generate(second, params)
    print(json.dumps({
        "tokens": list(out.token_ids),
        "prefill": engine.stats.prefill_tokens - before,
        "cached": out.cached_tokens,
        "disk": out.cached_tokens_by_tier["disk"],
    }))
    """
)


def test_killed_process_resumes_a_paused_session_from_disk(tmp_path: Path) -> None:
    script = tmp_path / "restart.py"
    script.write_text(RESTART)
    disk = str(tmp_path / "disk")
    args = [json.dumps(FIRST), json.dumps(SECOND)]

    def run(phase: str) -> str:
        done = subprocess.run(
            [sys.executable, str(script), phase, disk, *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[-1]

    first = json.loads(run("before"))
    after = json.loads(run("after"))
    ref = reference("tiny")
    assert [first, after["tokens"]] == ref[:2]
    history_before_turn = len(FIRST) + len(first)
    on_disk = (len(FIRST) + len(first) - 1) // 16 * 16
    assert after["disk"] >= (len(FIRST) // 16) * 16
    # Only what was not on disk is prefilled: the partial tail, then the new prompt.
    assert after["prefill"] == history_before_turn + len(SECOND) - after["cached"]
    assert after["cached"] >= on_disk - 16
