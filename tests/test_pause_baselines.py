"""The oracle, InferCept-style and Continuum-style pause policies, on hand-worked cases.

Every case prices a 1 GB state of 1,000 tokens: recompute at 1,000 tokens/s takes 1 s, a
host reload over 10 GB/s takes 0.1 s (0.2 s out and back), 4 GB is in use on the device.
"""

from __future__ import annotations

import math

import pytest

from kvpilot.policy.baselines import (
    Continuum,
    InferCept,
    Oracle,
    continuum_ttl,
    infercept_waste,
    mean_tool_wait,
)
from kvpilot.policy.breakeven import PauseAction, PauseInputs, decide_pause
from kvpilot.policy.pause import POLICY_NAMES, TRUE_WAIT_POLICIES, make_pause_policy

GB = 1e9


def inputs(wait_s: float, **kw: object) -> PauseInputs:
    base: dict[str, object] = {
        "kv_bytes": 1 * GB,
        "num_tokens": 1000,
        "expected_wait_s": wait_s,
        "device_host_bw_bytes_s": 10 * GB,
        "host_disk_bw_bytes_s": 0.0,
        "prefill_tokens_per_s": 1000.0,
        "device_used_bytes": 4 * GB,
    }
    base.update(kw)
    return PauseInputs(**base)  # type: ignore[arg-type]


def test_the_new_policies_are_available_by_name() -> None:
    assert {"oracle", "infercept", "continuum", "infercept-oracle"} <= set(POLICY_NAMES)
    assert {"oracle", "infercept-oracle"} == TRUE_WAIT_POLICIES
    assert isinstance(make_pause_policy("oracle"), Oracle)
    assert make_pause_policy("infercept") == InferCept()
    assert make_pause_policy("infercept-oracle") == InferCept("infercept-oracle", true_wait=True)
    assert make_pause_policy("continuum", ttl_s=7.0) == Continuum(default_ttl_s=7.0)


@pytest.mark.parametrize("wait_s", [0.05, 0.5, 30.0, 3600.0])
def test_oracle_is_the_rule_on_the_wait_it_is_given(wait_s: float) -> None:
    i = inputs(wait_s)
    d, rule = Oracle().decide(i), decide_pause(i)
    assert d.action is rule.action and d.break_even_wait_s == rule.break_even_wait_s
    assert d.reason.startswith(f"{rule.action.label} (oracle, on the true wait)")
    assert Oracle().lease_s(i) == math.inf


def test_infercept_waste_by_hand() -> None:
    # retain: 1 GB x 2 s = 2 GB·s; drop: 1 s x 4 GB = 4 GB·s; host: 0.2 s x 1 GB = 0.2 GB·s
    w = infercept_waste(inputs(2.0))
    assert w[PauseAction.RETAIN] == pytest.approx(2 * GB)
    assert w[PauseAction.DROP] == pytest.approx(4 * GB)
    assert w[PauseAction.OFFLOAD_HOST] == pytest.approx(0.2 * GB)
    assert PauseAction.OFFLOAD_DISK not in w


@pytest.mark.parametrize(
    ("wait_s", "kw", "action"),
    [
        (0.1, {}, PauseAction.RETAIN),  # 0.1 GB·s held < 0.2 GB·s swapped
        (1.0, {}, PauseAction.OFFLOAD_HOST),  # 1 GB·s held > 0.2 GB·s swapped
        (1.0, {"host_free_bytes": 0.0}, PauseAction.RETAIN),  # no host: 1 < 4 GB·s dropped
        (10.0, {"host_free_bytes": 0.0}, PauseAction.DROP),  # 10 GB·s held > 4 dropped
        # disk at 1 GB/s: 2 s out and back, 2 GB·s < 4 GB·s dropped < 10 GB·s held
        (10.0, {"host_free_bytes": 0.0, "host_disk_bw_bytes_s": 1 * GB}, PauseAction.OFFLOAD_DISK),
    ],
)
def test_infercept_takes_the_least_waste(
    wait_s: float, kw: dict[str, object], action: PauseAction
) -> None:
    d = InferCept().decide(inputs(wait_s, **kw))
    assert d.action is action, d.reason
    assert d.reason.startswith(f"{action.label} 1.0 GB (InferCept")


def test_infercept_estimates_the_wait_as_the_mean_of_the_tools_waits() -> None:
    # hint 10 s, but pytest's waits so far average 0.1 s: 0.1 GB·s held < 0.2 GB·s swapped
    i = inputs(10.0, tool="pytest", tool_waits=(0.05, 0.15, 0.1))
    assert mean_tool_wait(i) == pytest.approx(0.1)
    d = InferCept().decide(i)
    assert d.action is PauseAction.RETAIN and "expected 100 ms wait" in d.reason, d.reason
    # told the true wait, it takes it: 10 GB·s held > 0.2 GB·s swapped
    assert InferCept(true_wait=True).decide(i).action is PauseAction.OFFLOAD_HOST
    # no history yet: the engine's prediction (the hint)
    assert mean_tool_wait(inputs(10.0)) == 10.0


def test_infercept_ignores_device_pressure_where_the_rule_retains() -> None:
    i = inputs(1.0, device_pressure=0.1)
    assert decide_pause(i).action is PauseAction.RETAIN
    assert InferCept().decide(i).action is PauseAction.OFFLOAD_HOST


def test_continuum_lease_by_hand() -> None:
    # waits 1, 1, 1, 10; saving a recompute is worth 1 s x 4 GB = 4 GB·s.
    # t = 1: 3/4 x 4 - 1 GB x E[min(W, 1)] = 3 - 1 = 2 GB·s
    # t = 10: 1 x 4 - 1 GB x (1 + 1 + 1 + 10) / 4 = 4 - 3.25 = 0.75 GB·s
    i = inputs(5.0, tool="pytest", tool_waits=(1.0, 10.0, 1.0, 1.0))
    assert continuum_ttl(i, 99.0) == 1.0
    d = Continuum().decide(i)
    assert d.action is PauseAction.RETAIN and "pytest" in d.reason
    assert Continuum().lease_s(i) == 1.0


def test_continuum_counts_the_memory_held_by_waits_past_the_lease() -> None:
    # waits 1, 4: t = 1 holds 1 GB for min(W, 1) = 1 on average: 2 - 1 = 1 GB·s;
    # t = 4 saves both: 4 - (1 + 4) / 2 = 1.5 GB·s, so the lease covers the slower call.
    assert continuum_ttl(inputs(5.0, tool_waits=(4.0, 1.0)), 0.0) == 4.0


def test_continuum_pins_nothing_when_no_lease_pays() -> None:
    # t = 100: 0.5 x 4 - (100 + 100) / 2 < 0; t = 200: 4 - 150 < 0
    i = inputs(5.0, tool="approval", tool_waits=(100.0, 200.0))
    assert continuum_ttl(i, 10.0) == 0.0
    d = Continuum().decide(i)
    assert d.action is PauseAction.CACHE, d.reason


def test_continuum_without_history_pins_for_its_default_lease() -> None:
    i = inputs(5.0, tool="grep")
    assert Continuum(default_ttl_s=3.0).lease_s(i) == 3.0
    assert Continuum(default_ttl_s=3.0).decide(i).action is PauseAction.RETAIN


def test_pause_inputs_reject_negative_device_use() -> None:
    from kvpilot.errors import ConfigError

    with pytest.raises(ConfigError, match="device_used_bytes"):
        inputs(1.0, device_used_bytes=-1.0)


@pytest.mark.parametrize(
    ("wait_s", "used_gb", "disk_bw", "action"),
    [
        (2.0, 0.0, 0.0, PauseAction.DROP),  # unknown use: 2 s past the 1 s recompute
        (2.0, 4.0, 0.0, PauseAction.RETAIN),  # the recompute stalls 4 GB: 4 s of device time
        (10.0, 4.0, 0.0, PauseAction.DROP),
        (10.0, 4.0, 0.5 * GB, PauseAction.OFFLOAD_DISK),  # a 2 s disk reload beats 4 s
        (10.0, 0.0, 0.5 * GB, PauseAction.DROP),  # ...but not a 1 s recompute
    ],
)
def test_the_rule_prices_a_recompute_by_the_device_it_stalls(
    wait_s: float, used_gb: float, disk_bw: float, action: PauseAction
) -> None:
    i = inputs(
        wait_s,
        device_used_bytes=used_gb * GB,
        host_free_bytes=0.0,
        host_disk_bw_bytes_s=disk_bw,
    )
    assert decide_pause(i).action is action, decide_pause(i).reason
