"""`kvpilot sim` from the command line: summaries, policy comparison, figures, replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvpilot.cli.sim import sim
from kvpilot.errors import ConfigError
from kvpilot.units import parse_duration

SMALL = """\
arrival: {concurrent: 6, ramp_s: 2}
trajectory:
  turns: {dist: uniform, low: 2, high: 4}
  task_tokens: 300
  observation_tokens: {dist: lognormal, median: 100, sigma: 1.0, max: 2000}
  output_tokens: 30
shared_prefix: {system_tokens: 256, tool_tokens: 256}
tools:
  bash: {weight: 1, wait: {dist: lognormal, median: 2, sigma: 0.5}}
branching: {probability: 0.2, fork_factor: 2, max_depth: 1, branch_turns: 1}
"""

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def cli() -> tuple[typer.Typer, CliRunner]:
    app = typer.Typer()
    app.command()(sim)

    @app.command()
    def other() -> None:  # a second command keeps typer in multi-command mode
        pass

    return app, CliRunner()


def small_workload(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    return path


BASE = ["sim", "--model", "llama-3-8b", "--node", "h100", "--kv-blocks", "3000"]


def test_sim_json_summary_has_the_headline_figures(cli, tmp_path) -> None:
    app, runner = cli
    args = [*BASE, "--workload", str(small_workload(tmp_path)), "--duration", "60s", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in (
        "output_tokens_per_s",
        "trajectories_per_hour",
        "ttft_p50_s",
        "ttft_p99_s",
        "itl_p50_s",
        "itl_p99_s",
        "kv_usage_max",
        "hit_rate",
        "recomputed_tokens",
        "bytes_moved",
        "preemptions",
        "pause_decisions",
    ):
        assert key in data
    assert data["duration_s"] == pytest.approx(60.0)
    assert data["output_tokens_per_s"] > 0
    assert 0 < data["hit_rate"] < 1


def test_sim_block_size_and_sizes_with_units(cli, tmp_path) -> None:
    app, runner = cli
    args = [*BASE, "--workload", str(small_workload(tmp_path)), "--duration", "20s", "--json"]
    args += ["--block-size", "32", "--host-memory", "1GB", "--reserve", "3GB"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["block_size"] == 32
    bytes_per_block = 32 * 131072  # llama-3-8b: 128 KiB of KV per token
    assert data["host_blocks"] == 10**9 // bytes_per_block


def test_sim_table_output_and_figures(cli, tmp_path) -> None:
    app, runner = cli
    out = tmp_path / "figs"
    args = [
        *BASE,
        "--workload",
        str(small_workload(tmp_path)),
        "--duration",
        "40s",
        "--compare-policies",
        "--policies",
        "no-prefix-cache,tau-0.8",
        "--out",
        str(out),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "policy comparison" in result.output
    assert "TTFT p50 / p99" in result.output
    for name in (
        "kv_usage.png",
        "latency.png",
        "policies.png",
        "breakeven.png",
        "capacity.png",
        "kv_usage-tau-0.8.png",
    ):
        assert (out / name).read_bytes()[:8] == PNG, name
    summary = json.loads((out / "summary.json").read_text())
    assert [s["label"] for s in summary] == ["breakeven", "no-prefix-cache", "tau-0.8"]


def test_sim_replays_a_hashed_trace(cli, tmp_path) -> None:
    app, runner = cli
    rows = [
        {
            "timestamp": 0.0,
            "input_length": 500,
            "output_length": 20,
            "hash_ids": list(range(32)),
            "session_id": "s",
        },
        {
            "timestamp": 2.0,
            "input_length": 700,
            "output_length": 20,
            "hash_ids": list(range(44)),
            "session_id": "s",
        },
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    result = runner.invoke(app, [*BASE, "--trace", str(trace), "--duration", "30", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["calls"] == 2 and data["trajectories_completed"] == 1
    assert data["cached_tokens"] == 496


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--duration", "soon"], "cannot read --duration 'soon'"),
        (["--policy", "fastest"], "unknown policy 'fastest': use one of default"),
        (["--model", "gpt-9"], "unknown model 'gpt-9'"),
        (["--trace", "/nonexistent/trace.jsonl"], "does not exist"),
        (["--reserve", "2.5"], "--reserve '2.5' has no unit: write e.g. 2.5GB or 2.5GiB"),
        (["--host-memory", "64"], "--host-memory '64' has no unit"),
        (["--host-kv", "lots"], "cannot read --host-memory 'lots'"),
        (["--block-size", "12"], "block_size must be a power of two, got 12"),
        (["--tau-high", "1.5"], "tau_high must be in (0, 1], got 1.5"),
        (
            ["--kv-dtype", "int4"],
            "--kv-dtype: unknown KV dtype 'int4': use one of bf16, fp16, fp32, fp8",
        ),
        (["--node", "8xtpu"], "--node: unknown accelerator 'tpu': use one of a100-40"),
        (["--tp", "3"], "tensor parallel degree 3 must divide"),
        (["--sessions", "0"], "--sessions must be at least 1, got 0"),
        (["--sessions", "2"], "--sessions 2: replay limits apply to --trace replays"),
        (["--calls", "0", "--trace", "miniswe"], "--calls must be at least 1, got 0"),
        (["--sample-interval", "0"], "--sample-interval must be positive"),
    ],
)
def test_sim_bad_options_fail_with_a_message(cli, args, message) -> None:
    app, runner = cli
    base = [a for a in BASE if a not in ("--kv-blocks", "3000")] if "--tp" in args else BASE
    result = runner.invoke(app, [*base, *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def hashed_rows(sid: str, start: float, gaps: list[float], n_in: int = 400) -> list[dict]:
    rows, t = [], start
    for i, gap in enumerate([0.0, *gaps]):
        t += gap
        n = n_in + 100 * i
        rows.append(
            {
                "timestamp": t,
                "input_length": n,
                "output_length": 20,
                "hash_ids": list(range(1000 * len(sid), 1000 * len(sid) + n // 16)),
                "session_id": sid,
            }
        )
    return rows


def test_sim_replay_limits_are_named_flags(cli, tmp_path) -> None:
    app, runner = cli
    rows = hashed_rows("a", 0.0, [5, 5, 5]) + hashed_rows("bb", 1.0, [5, 5, 5])
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    args = [*BASE, "--trace", str(trace), "--duration", "60", "--json"]
    full = json.loads(runner.invoke(app, args).stdout)
    assert (full["calls"], full["trajectories_started"]) == (8, 2)
    limited = runner.invoke(app, [*args, "--sessions", "1", "--calls", "2"])
    assert limited.exit_code == 0, limited.output
    assert json.loads(limited.stdout)["calls"] == 2
    short = json.loads(runner.invoke(app, [*args, "--max-call-tokens", "500"]).stdout)
    assert short["calls"] == 4  # each session stops before its 600-token call
    none = runner.invoke(app, [*args, "--max-call-tokens", "100"])
    assert none.exit_code == 2
    out = " ".join(none.output.split())
    assert "no session that fits the replay limits (limits: --max-call-tokens 100" in out
    assert "the shortest first call has 400 tokens: raise --max-call-tokens" in out


def test_sim_replay_skips_empty_calls(cli, tmp_path) -> None:
    app, runner = cli
    rows = [
        {"timestamp": 0.0, "input": "", "output": "x", "session_id": "s"},
        {"timestamp": 1.0, "input": "hello " * 50, "output": "ok " * 5, "session_id": "s"},
        {"timestamp": 2.0, "input": "", "output": "", "session_id": "s"},
        {"timestamp": 3.0, "input": "hello " * 60, "output": "ok", "session_id": "s"},
    ]
    trace = tmp_path / "text.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    result = runner.invoke(app, [*BASE, "--trace", str(trace), "--duration", "30", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["calls"] == 2 and data["empty_calls_skipped"] == 2


def test_compare_policies_on_a_trace_compares_pauses(cli, tmp_path) -> None:
    app, runner = cli
    rows = [r for k in range(6) for r in hashed_rows("s" * (k + 1), k * 0.5, [20, 20, 20], 900)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    args = [*BASE, "--trace", str(trace), "--duration", "120", "--json", "--compare-policies"]
    result = runner.invoke(app, [*args, "--policies", "retain,drop,offload-host"])
    assert result.exit_code == 0, result.output
    by = {r["label"]: r for r in json.loads(result.stdout)}
    assert by["breakeven"]["tool_pauses"] == 18  # three gaps in each of six sessions
    assert by["retain"]["pause_decisions"].get("retain", 0) == 18
    assert by["drop"]["pause_decisions"].get("drop", 0) == 18
    assert by["offload-host"]["bytes_moved"] > 0 == by["retain"]["bytes_moved"]
    assert by["drop"]["hit_rate"] < by["retain"]["hit_rate"]


def test_sim_with_a_profile_names_the_profiled_model(cli, tmp_path) -> None:
    from kvpilot.sim.profile import StepProfile

    app, runner = cli
    path = tmp_path / "profile.json"
    StepProfile(
        "my-tiny", "cpu", "float32", 16, (1e-3, 1e-5, 1e-4, 0, 0, 0), 1e-6, 50, 0.9, 0.1
    ).save(path)
    args = ["sim", "--profile", str(path), "--kv-blocks", "500", "--duration", "20", "--json"]
    args += ["--workload", str(small_workload(tmp_path))]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"] == "my-tiny" and "calibrated profile" in data["node"]


def test_durations_read_with_units() -> None:
    assert parse_duration("3600") == 3600
    assert parse_duration("90s") == 90
    assert parse_duration("30m") == 1800
    assert parse_duration("1.5h") == 5400
    assert parse_duration("250ms") == 0.25
    for bad in ("", "1 hour", "-3s", "0"):
        with pytest.raises(ConfigError):
            parse_duration(bad)
