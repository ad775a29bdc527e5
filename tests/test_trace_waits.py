"""Pause waits from a trace's own gaps, per tool, with a tail of human approvals."""

from __future__ import annotations

import pytest

from kvpilot.errors import ConfigError
from kvpilot.trace.loader import TraceCall, TraceSession
from kvpilot.trace.waits import APPROVAL_TOOL, DEFAULT_TOOL, WaitModel, tool_of


def session(*calls: tuple[float, str]) -> TraceSession:
    return TraceSession("s", tuple(TraceCall("s", t, "prompt", out) for t, out in calls))


@pytest.mark.parametrize(
    ("output", "tool"),
    [
        ("THOUGHT: look\n```bash\ngrep -rn foo src/\n```", "grep"),
        ("```bash\ncd /testbed && python -m pytest -x\n```", "python"),
        ("```bash\ncd /a && cd b && /usr/bin/sed -i s/a/b/ f\n```", "sed"),
        ("no command here", DEFAULT_TOOL),
        ("```bash\n\n```", DEFAULT_TOOL),
    ],
)
def test_the_tool_is_the_first_program_of_the_bash_block(output: str, tool: str) -> None:
    assert tool_of(output) == tool


def test_waits_are_the_recorded_gaps_named_by_tool() -> None:
    s = session((0.0, "```bash\ngrep x\n```"), (1.5, "```bash\npytest\n```"), (4.0, "done"))
    waits = WaitModel(approval_probability=0.0).waits(s)
    assert [(w.wait_s, w.tool) for w in waits] == [(1.5, "grep"), (2.5, "pytest")]


def test_approvals_add_a_scaled_log_uniform_wait() -> None:
    calls = [(float(i), "```bash\nls\n```") for i in range(400)]
    model = WaitModel(time_factor=0.01, approval_probability=0.25, seed=3)
    waits = model.waits(session(*calls))
    approvals = [w for w in waits if w.tool == APPROVAL_TOOL]
    assert 60 < len(approvals) < 140  # about a quarter of 399 pauses
    for w in approvals:
        assert 1.0 + 60 * 0.01 <= w.wait_s <= 1.0 + 3600 * 0.01
    assert all(w.wait_s == 1.0 for w in waits if w.tool != APPROVAL_TOOL)
    assert model.waits(session(*calls)) == waits  # seeded: every policy sees the same
    assert WaitModel(0.01, 0.25, seed=4).waits(session(*calls)) != waits


def test_wait_model_rejects_nonsense() -> None:
    with pytest.raises(ConfigError):
        WaitModel(time_factor=0.0)
    with pytest.raises(ConfigError):
        WaitModel(approval_probability=1.5)
    with pytest.raises(ConfigError):
        WaitModel(approval_min_s=10.0, approval_max_s=5.0)
