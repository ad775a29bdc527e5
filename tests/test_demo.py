"""`kvpilot demo`: agent sessions replayed against a real `kvpilot serve` child process."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from kvpilot.demo.client import (
    AgentClient,
    ScriptBudget,
    TurnResult,
    Verification,
    clip,
    ideal_hit_rate_of,
    load_scripts,
    scripts_from_trace,
    synthetic_scripts,
    tool_of,
)
from kvpilot.demo.run import DemoConfig, run_engine_demo
from kvpilot.errors import ConfigError
from kvpilot.server.process import ServeProcess, ServerStartError

TASK = "<pr_description>Fix the parser: it crashes on an empty string.</pr_description>\n" * 8


def write_trace(folder: Path) -> Path:
    """One recorded session of three calls, each input extending the previous one."""
    folder.mkdir()
    inputs = [TASK, TASK + "<output>IndexError</output>\n", TASK + "<output>IndexError</output>\n"]
    inputs[2] += "<output>14 passed</output>\n"
    outputs = [
        "THOUGHT: run the tests.\n```bash\npytest tests/test_parser.py\n```",
        "THOUGHT: look at it.\n```bash\n/usr/bin/cat parser.py\n```",
        "done",
    ]
    rows = [
        {"timestamp": 1_000_000 * (10 + 2 * i), "input": inp, "output": out, "session_id": "s-1"}
        for i, (inp, out) in enumerate(zip(inputs, outputs, strict=True))
    ]
    (folder / "trace.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


def test_the_demo_serves_pauses_and_summarizes_consistently(tmp_path: Path) -> None:
    config = DemoConfig(
        budget=ScriptBudget(sessions=1, turns=2, first_bytes=512, turn_bytes=128),
        max_tokens=8,
        trace_dir=write_trace(tmp_path / "trace"),
    )
    out = io.StringIO()
    summary = run_engine_demo(Console(file=out, width=100), "tiny", config)
    assert summary.sessions == 1 and summary.turns == 2 and summary.pauses == 1
    pauses = sum(n for action, n in summary.decisions.items() if action != "demoted")
    assert pauses == summary.pauses
    assert 0 < summary.hit_rate <= summary.ideal_hit_rate
    assert sum(summary.cached_by_tier.values()) == summary.cached_tokens
    assert summary.server_exit_code == 0  # stopped cleanly, engine closed
    assert summary.recomputed_turns == 1 and summary.mismatches == 0
    text = out.getvalue()
    assert "pytest runs 0.50 s" in text  # the tool and its (x0.25) wait, from the trace
    # The child server's start-up banner is shown while it starts.
    for step in ("serve | loading PyTorch", "serve | KV pool: 256 blocks", "serve | ready in"):
        assert step in text, step
    summary_text = text[text.index("what happened") :]
    for figure in ("prefix hit rate", "demotions", "prefetch hits · stalls", "KV moved"):
        assert figure in summary_text, figure
    assert summary_text.count("good:") >= 3  # what a good value is, for the puzzling ones
    assert "offload_host" not in text and "retain retain" not in text  # words, said once
    assert all(len(line) <= 100 for line in text.splitlines() if not line.startswith("$ "))
    assert "--poison-freed-blocks" in text and "1 resumed turns recomputed" in text
    assert "1 checked, 0 mismatches" in summary_text


def test_trace_scripts_send_new_context_with_the_next_tool_and_its_wait(tmp_path: Path) -> None:
    budget = ScriptBudget(sessions=1, turns=3, first_bytes=100, turn_bytes=10, time_scale=0.5)
    (script,) = scripts_from_trace(write_trace(tmp_path / "t"), budget)
    first, second, third = script.turns
    assert first.text == TASK[:100]
    assert second.text == "<output>In"  # only what the call appended, clipped
    assert (first.tool, first.tool_wait_s) == ("pytest", 1.0)
    assert (second.tool, second.tool_wait_s) == ("cat", 1.0)
    assert third.tool is None


def test_without_traces_the_demo_uses_a_synthetic_agent(tmp_path: Path) -> None:
    budget = ScriptBudget(sessions=2, turns=3, first_bytes=200, turn_bytes=50)
    scripts, source = load_scripts(tmp_path / "missing", budget)
    assert "synthetic" in source and scripts == synthetic_scripts(budget)
    assert [len(s.turns) for s in scripts] == [3, 3]
    for script in scripts:
        assert all(t.tool is not None and t.tool_wait_s > 0 for t in script.turns[:-1])
        assert script.turns[-1].tool is None
        assert len(script.turns[0].text.encode()) <= 200


def test_text_is_clipped_by_utf8_bytes_without_splitting_a_character() -> None:
    assert clip("héllo", 2) == "h"
    assert clip("héllo", 3) == "hé"
    assert tool_of("no command here") == "bash"


def turn(prompt: list[int], output: list[int], sent_at: float, session: str = "s") -> TurnResult:
    return TurnResult(
        script=session,
        session_id=session,
        turn=0,
        sent_at=sent_at,
        latency_s=0.0,
        prompt_tokens=len(prompt),
        cached_tokens=0,
        cached_by_tier={"device": 0, "host": 0, "disk": 0},
        completion_tokens=len(output),
        prompt_token_ids=tuple(prompt),
        completion_token_ids=tuple(output),
        tool=None,
        tool_wait_s=0.0,
        pause=None,
    )


def test_the_ideal_reuses_a_sessions_own_context_up_to_its_last_output_token() -> None:
    first = list(range(20))
    output = list(range(100, 112))
    second = first + output + [7] * 5  # 37 tokens: the first 31 had their KV computed
    results = [turn(second, [], 2.0), turn(first, output, 1.0)]  # sending order counts
    assert ideal_hit_rate_of(results, 16) == pytest.approx(31 / (20 + 37))


def test_the_ideal_shares_whole_blocks_across_sessions() -> None:
    first = list(range(40))
    other = [*first[:35], 9, 9, 9]  # 35 tokens in common: 2 whole blocks of 16
    results = [turn(first, [1], 1.0, "a"), turn(other, [1], 2.0, "b")]
    assert ideal_hit_rate_of(results, 16) == pytest.approx(32 / (40 + 38))


def test_a_budget_that_overflows_the_context_is_refused() -> None:
    with pytest.raises(ConfigError, match="context"):
        DemoConfig(budget=ScriptBudget(turns=20, first_bytes=4000, turn_bytes=400))


def test_a_server_that_cannot_start_reports_its_log(tmp_path: Path) -> None:
    server = ServeProcess(["--policy", "yolo"], log_path=tmp_path / "serve.log")
    with pytest.raises(ServerStartError, match="yolo"):
        server.start()
    assert server.returncode not in (None, 0)


def test_verification_counts_a_turn_that_differs_from_its_recompute() -> None:
    from kvpilot.cli.serve import ServeOptions, build_app
    from kvpilot.engine.config import EngineConfig
    from kvpilot.server.background import BackgroundServer

    prompt = tuple(TASK.encode()[:100])
    config = EngineConfig.from_kwargs(kv_blocks=64)
    with (
        BackgroundServer(build_app(ServeOptions(engine=config))) as server,
        AgentClient(server.base_url, max_tokens=4) as client,
    ):
        response = client.openai.completions.create(
            model="tiny",
            prompt=list(prompt),
            max_tokens=4,
            temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        out = tuple((response.model_extra or {})["kvpilot"]["completion_token_ids"][0])
        turn = TurnResult(
            script="s",
            session_id="sess",
            turn=1,
            sent_at=0.0,
            latency_s=0.0,
            prompt_tokens=len(prompt),
            cached_tokens=0,
            cached_by_tier={},
            completion_tokens=len(out),
            prompt_token_ids=prompt,
            completion_token_ids=out,
            tool=None,
            tool_wait_s=0.0,
            pause=None,
        )
        assert client.verify([turn]) == Verification(1, ())
        wrong = dataclasses.replace(turn, completion_token_ids=(*out[:3], (out[3] + 1) % 256))
        verification = client.verify([wrong, dataclasses.replace(turn, turn=0)])
    assert verification.checked == 1 and len(verification.mismatches) == 1
    assert "s turn 2" in verification.mismatches[0]
