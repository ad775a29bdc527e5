"""bench_pause's workload: trace sessions, copies with their own approvals, dilated waits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvpilot.errors import ConfigError
from kvpilot.trace.waits import APPROVAL_TOOL, WaitModel

MINISWE = Path(__file__).resolve().parents[2] / "shared/traces/lmcache-agent-trace/miniswe"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import pause_workload  # noqa: E402
from pause_workload import Turn, common_prefix, dilated, load_sessions, tokenize  # noqa: E402


def test_longer_chunks_make_fewer_tokens_with_the_same_prefixes() -> None:
    text = "def f(x):\n    return x + 1\n" * 8
    four, eight = tokenize(text, 256), tokenize(text, 256, chars_per_token=8)
    assert len(four) == -(-len(text) // 4) and len(eight) == -(-len(text) // 8)
    longer = tokenize(text + "# more", 256, chars_per_token=8)
    assert longer[: len(eight) - 1] == eight[:-1]  # prefix-stable


def test_dilation_stretches_waits_only() -> None:
    sessions = [[Turn([1, 2], 1.5, "ls"), Turn([1, 2, 3], 0.0, "")]]
    (stretched,) = dilated(sessions, 4.0)
    assert [t.wait_s for t in stretched] == [6.0, 0.0]
    assert [(t.tokens, t.tool) for t in stretched] == [(t.tokens, t.tool) for t in sessions[0]]
    with pytest.raises(ConfigError):
        dilated(sessions, 0.0)


@pytest.mark.skipif(not MINISWE.exists(), reason="the miniswe trace is not here")
def test_copies_of_the_trace_have_their_own_approvals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pause_workload, "TRACES", MINISWE)
    waits = WaitModel(0.01, 0.3, seed=5)
    one = load_sessions(100, 1024, waits, 256, 6, chars_per_token=8)
    two = load_sessions(100, 1024, waits, 256, 6, chars_per_token=8, replicas=2)
    assert len(two) == 2 * len(one) and two[: len(one)] == one  # copy 0 is the trace's own
    copies = two[len(one) :]
    # Another agent's words: the same lengths, no prefix shared with the trace's own...
    assert [[len(t.tokens) for t in s] for s in copies] == [[len(t.tokens) for t in s] for s in one]
    assert all(common_prefix(c[0].tokens, o[0].tokens) < 8 for c in copies for o in one)
    # ...but what it shares with its own sessions, as the trace's do.
    assert common_prefix(copies[0][0].tokens, copies[1][0].tokens) == common_prefix(
        one[0][0].tokens, one[1][0].tokens
    )
    assert common_prefix(one[0][0].tokens, one[1][0].tokens) > 0
    assert [[t.wait_s for t in s] for s in copies] != [[t.wait_s for t in s] for s in one]
    approvals = [t for s in two for t in s[:-1] if t.tool == APPROVAL_TOOL]
    assert approvals and all(t.wait_s >= 0.6 for t in approvals)  # a minute x 0.01
    for s in two:
        assert len(s) >= 2 and len(s) <= 6 and s[-1].wait_s == 0.0
        assert all(len(t.tokens) <= 1024 for t in s)
    assert load_sessions(3, 1024, waits, 256, 6, chars_per_token=8, replicas=2) == one[:3]
