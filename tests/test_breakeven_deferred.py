"""A decision step 1 of the rule takes (plentiful device memory) is built with only its action:
its figures are worked out when first read, and must equal those of a decision built whole."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.policy import breakeven
from kvpilot.policy.breakeven import (
    DEFAULT_THRESHOLDS,
    ENGINE_THRESHOLDS,
    PauseAction,
    PauseDecision,
    PauseInputs,
    PauseThresholds,
    decide_pause,
)

inputs_st = st.builds(
    PauseInputs,
    kv_bytes=st.one_of(st.just(0.0), st.floats(1e6, 1e11)),
    num_tokens=st.integers(1, 1 << 18),
    expected_wait_s=st.floats(0.0, 1e5),
    device_host_bw_bytes_s=st.one_of(st.just(0.0), st.floats(1e9, 1e12)),
    host_disk_bw_bytes_s=st.one_of(st.just(0.0), st.floats(1e8, 5e10)),
    prefill_tokens_per_s=st.floats(1e2, 1e6),
    device_pressure=st.floats(0.0, 0.999),
    host_pressure=st.floats(0.0, 1.0),
    host_free_bytes=st.floats(0.0, 1e12),
    stall_tolerance_s=st.floats(0.0, 10.0),
    device_used_bytes=st.floats(0.0, 1e12),
)
FIGURES = [
    f.name for f in dataclasses.fields(PauseDecision) if f.name not in ("action", "reason", "basis")
]


def same(a: object, b: object) -> bool:
    both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return a == b or both_nan


@given(inputs_st, st.sampled_from([DEFAULT_THRESHOLDS, ENGINE_THRESHOLDS]))
def test_a_deferred_decision_reads_the_figures_of_one_built_whole(
    inputs: PauseInputs, thresholds: PauseThresholds
) -> None:
    plentiful = dataclasses.replace(thresholds, device_plentiful_below=1.0)
    deferred = decide_pause(inputs, plentiful)
    # No pressure is under 0: step 1 never decides, and the decision is built whole.
    whole = decide_pause(inputs, dataclasses.replace(thresholds, device_plentiful_below=0.0))
    assert deferred.action is PauseAction.RETAIN
    for name in FIGURES:
        assert same(getattr(deferred, name), getattr(whole, name)), name
    assert deferred.reason.startswith("Retain: device memory is plentiful")


def test_every_figure_of_a_decision_is_filled_when_deferred() -> None:
    assert sorted(FIGURES) == sorted(breakeven._FIGURE_FIELDS)


def test_a_deferred_decision_works_its_figures_out_once_when_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = 0
    figures = breakeven._figures

    def counted(*args: object) -> object:
        nonlocal calls
        calls += 1
        return figures(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(breakeven, "_figures", counted)
    inputs = PauseInputs(1e9, 1000, 30.0, 1e10, 1e9, 1e4, device_pressure=0.2)
    d = decide_pause(inputs, ENGINE_THRESHOLDS)
    assert d.action is PauseAction.RETAIN and calls == 0  # decided on the pressure alone
    assert d.reload_s == pytest.approx(0.1) and calls == 1
    assert d.round_trip_s == pytest.approx(0.2) and d.via is PauseAction.OFFLOAD_HOST
    assert calls == 1  # every figure was filled by the first read


def test_a_deferred_decision_is_a_value_like_any_other() -> None:
    inputs = PauseInputs(1e9, 1000, 30.0, 1e10, 1e9, 1e4, device_pressure=0.2)
    whole = PauseDecision(
        PauseAction.RETAIN,
        "",
        *breakeven._figure_values(inputs, ENGINE_THRESHOLDS),
        basis=(inputs, ENGINE_THRESHOLDS),
    )
    for d in (decide_pause(inputs, ENGINE_THRESHOLDS) for _ in range(4)):
        assert d == whole and hash(d) == hash(whole)
    d = decide_pause(inputs, ENGINE_THRESHOLDS)
    assert repr(d) == repr(whole) and "basis" not in repr(d)
    assert pickle.loads(pickle.dumps(decide_pause(inputs, ENGINE_THRESHOLDS))) == whole
    moved = dataclasses.replace(decide_pause(inputs, ENGINE_THRESHOLDS), action=PauseAction.DROP)
    assert moved.reload_s == whole.reload_s and moved.reason == whole.reason
    with pytest.raises(AttributeError):
        decide_pause(inputs, ENGINE_THRESHOLDS).no_such_figure  # type: ignore[attr-defined]  # noqa: B018
