"""`kvpilot trace analyze`: reuse against the ideal, where prompts diverge, tool waits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvpilot.cli.trace import trace_analyze
from kvpilot.errors import ConfigError
from kvpilot.trace.analyze import (
    DEFAULT_ZONES,
    ZoneMarker,
    diagnose,
    load_zone_markers,
    zone_at,
    zone_starts,
)
from kvpilot.trace.schema import TraceInput, block_hash_ids, load_trace_inputs

MINISWE = Path(__file__).resolve().parents[2] / "shared/traces/lmcache-agent-trace/miniswe"

TASK = "<pr_description>\nFix the bug in the parser, it drops the last token.\n</pr_description>\n"
SYSTEM = "<instructions>\n" + "You are a careful engineer. " * 40 + "\n</instructions>\n"


def obs(i: int) -> str:
    return f"<returncode>0</returncode>\n<output>\nresult {i} " + "line of output\n" * 20


def text_row(session: str, t_us: int, text: str) -> dict[str, object]:
    return {"timestamp": t_us, "input": text, "output": "ok", "session_id": session}


def stable_and_broken(tmp_path: Path) -> Path:
    rows = []
    history = TASK + SYSTEM
    for i in range(4):
        rows.append(text_row("good", 1_000_000 * (i * 3), history))
        history += obs(i)
    history = SYSTEM + TASK
    for i in range(4):
        stamp = f"[request {i:04d} at 2025-01-0{i + 1}]\n"
        rows.append(text_row("bad", 1_000_000 * (i * 5) + 500, stamp + history))
        history += obs(i)
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_append_only_session_reuses_everything_before_the_new_observation(tmp_path) -> None:
    d = diagnose(load_trace_inputs([stable_and_broken(tmp_path)]))
    good = next(s for s in d.sessions if s.session_id == "good")
    assert not good.breaks
    for prev, call in zip(good.calls, good.calls[1:], strict=False):
        assert call.divergence_zone == "appended"
        assert call.reuse_tokens == (prev.prompt_tokens - 1) // 16 * 16
        assert call.ideal_tokens >= call.reuse_tokens


def test_a_volatile_head_breaks_the_layout_and_is_reported(tmp_path) -> None:
    d = diagnose(load_trace_inputs([stable_and_broken(tmp_path)]))
    bad = next(s for s in d.sessions if s.session_id == "bad")
    assert [c.index for c in bad.breaks] == [1, 2, 3]
    assert all(c.divergence is not None and c.divergence < 16 for c in bad.breaks)
    assert all(c.divergence_zone == "head" for c in bad.breaks)
    assert all(c.reuse_tokens == 0 and c.lost_tokens > 0 for c in bad.breaks)
    assert [s.session_id for s in d.breaking_sessions] == ["bad"]
    assert d.zones == {"appended": 3, "head": 3}


def test_ideal_hit_counts_sharing_across_sessions() -> None:
    shared = list(range(1, 161))
    calls = [
        TraceInput("a", 0.0, shared + [500] * 40),
        TraceInput("b", 1.0, shared + [600] * 40),
    ]
    d = diagnose(calls, block_size=16)
    b = d.sessions[1].calls[0]
    assert b.reuse_tokens == 0
    assert b.ideal_tokens == 160
    assert d.ideal_rate > d.reuse_rate


def test_gaps_between_calls_are_the_tool_waits(tmp_path) -> None:
    d = diagnose(load_trace_inputs([stable_and_broken(tmp_path)]))
    good = next(s for s in d.sessions if s.session_id == "good")
    assert good.gaps_s == pytest.approx([3.0, 3.0, 3.0])
    assert d.gaps.count == 6
    assert d.gaps.p50_s == pytest.approx(4.0)
    assert d.gaps.max_s == pytest.approx(5.0)


def test_zones_come_from_the_markers() -> None:
    text = TASK + SYSTEM + obs(0)
    starts = zone_starts(text, DEFAULT_ZONES)
    assert zone_at(5, starts) == "task"
    assert zone_at(len(TASK) + 20, starts) == "system"
    assert zone_at(len(TASK) + len(SYSTEM) + 3, starts) == "history"
    custom = [ZoneMarker("tools", "<tools>"), ZoneMarker("system", "<sys>")]
    assert zone_at(9, zone_starts("<sys> abc <tools> x", custom)) == "system"
    assert zone_at(12, zone_starts("<sys> abc <tools> x", custom)) == "tools"


def test_zone_markers_load_from_json(tmp_path) -> None:
    path = tmp_path / "zones.json"
    path.write_text(json.dumps([{"zone": "tools", "marker": "## Tools", "after": True}]))
    assert load_zone_markers(path) == (ZoneMarker("tools", "## Tools", True),)
    path.write_text(json.dumps([{"zone": "tools"}]))
    with pytest.raises(ConfigError, match="marker"):
        load_zone_markers(path)


def test_hashed_traces_are_diagnosed_without_zones(tmp_path) -> None:
    base = list(range(1, 100))
    prompts = [base, base + [5] * 40, [9] + base + [5] * 80]
    rows = [
        {
            "timestamp": float(i),
            "input_length": len(p),
            "output_length": 3,
            "hash_ids": block_hash_ids(p),
            "session_id": "s",
        }
        for i, p in enumerate(prompts)
    ]
    path = tmp_path / "h.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    d = diagnose(load_trace_inputs([path]))
    calls = d.sessions[0].calls
    assert calls[1].divergence_zone == "appended" and calls[1].reuse_tokens == 96
    assert calls[2].divergence_zone == "unknown" and calls[2].breaks_layout
    # Hashed blocks all change when one token is inserted: no telling what changed.
    assert calls[2].cause == "unknown"


def interleaved(tmp_path: Path, n_sessions: int = 1, turns: int = 4) -> Path:
    """Sessions where an orchestrator and a sub-agent share one session id."""
    rows = []
    sub = (
        "<instructions>\n"
        + "You are a sub-agent; you only read files. " * 30
        + "\n</instructions>\n"
    )
    for s in range(n_sessions):
        main, helper = TASK + SYSTEM, sub + "<task>read setup.py</task>\n"
        for i in range(turns):
            rows.append(text_row(f"mixed{s}", 10_000_000 * s + 1_000_000 * (2 * i), main))
            rows.append(text_row(f"mixed{s}", 10_000_000 * s + 1_000_000 * (2 * i + 1), helper))
            main += obs(i)
            helper += obs(100 + i)
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_sessions_mixing_conversations_are_split_and_not_layout_problems(tmp_path) -> None:
    d = diagnose(load_trace_inputs([interleaved(tmp_path)]))
    (s,) = d.sessions
    assert s.interleaved and len(s.conversations) == 2
    assert [c.calls for c in s.conversations] == [4, 4]
    assert [c.conversation for c in s.calls] == [0, 1] * 4
    assert not s.breaks and not d.breaking_sessions
    assert d.causes == {"interleaved_conversation": 7}
    # Each conversation reuses its own previous call: most of every prompt after the first.
    assert all(c.reuse_rate > 0.5 for c in s.conversations)
    assert all(c.reuse_tokens > 0 for c in s.calls[2:])
    assert [x.session_id for x in d.interleaved_sessions] == ["mixed0"]


def test_report_is_capped_at_top_n_with_counts(tmp_path) -> None:
    rows = []
    for s in range(30):
        history = SYSTEM + TASK
        for i in range(3):
            stamp = f"[request {i:04d} at 2025-01-0{i + 1}]\n"
            rows.append(text_row(f"s{s}", 100_000_000 * s + 1_000_000 * i, stamp + history))
            history += obs(i)
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    app = typer.Typer()
    app.command()(trace_analyze)
    result = CliRunner().invoke(app, [str(path), "--top", "5"], terminal_width=200)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "volatile_field_at_head" in out and "why prefixes break" in out
    assert "... and 25 more sessions" in out
    assert "... and 55 more breaking calls" in out
    assert out.count("\n") < 80  # 30 sessions x 3 calls would print well over 100 rows


def test_cli_prints_tables_json_and_a_plot(tmp_path) -> None:
    app = typer.Typer()
    app.command()(trace_analyze)
    trace = stable_and_broken(tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, [str(trace)])
    assert result.exit_code == 0, result.output
    assert "breaking calls" in result.output and "volatile_field_at_head" in result.output
    result = runner.invoke(app, [str(trace), "--json"])
    data = json.loads(result.output)
    assert data["breaking_sessions"] == ["bad"]
    assert data["tool_wait"]["count"] == 6
    plot = tmp_path / "diag.png"
    result = runner.invoke(app, [str(trace), "--plot", str(plot), "--turns"])
    assert result.exit_code == 0, result.output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = runner.invoke(app, [str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 2 and "does not exist" in result.output


@pytest.mark.skipif(not MINISWE.is_dir(), reason="miniswe traces not present")
def test_miniswe_sessions_are_append_only_and_near_ideal() -> None:
    files = sorted(MINISWE.glob("*.jsonl"))[:3]
    d = diagnose(load_trace_inputs(files))
    assert not d.breaking_sessions
    assert set(d.zones) == {"appended"}
    assert 0.8 < d.reuse_rate <= d.ideal_rate + 1e-9
    assert 0.1 < d.gaps.p50_s < 10
