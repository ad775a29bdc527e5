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
        (["--duration", "soon"], "cannot read duration"),
        (["--policy", "fastest"], "unknown policy"),
        (["--model", "gpt-9"], "unknown model"),
        (["--trace", "/nonexistent/trace.jsonl"], "does not exist"),
        (["--host-memory", "lots"], "cannot read size"),
        (["--block-size", "12"], "power of two"),
    ],
)
def test_sim_bad_options_fail_with_a_message(cli, args, message) -> None:
    app, runner = cli
    result = runner.invoke(app, [*BASE, *args])
    assert result.exit_code == 2
    assert message in result.output


def test_durations_read_with_units() -> None:
    assert parse_duration("3600") == 3600
    assert parse_duration("90s") == 90
    assert parse_duration("30m") == 1800
    assert parse_duration("1.5h") == 5400
    assert parse_duration("250ms") == 0.25
    for bad in ("", "1 hour", "-3s", "0"):
        with pytest.raises(ConfigError):
            parse_duration(bad)
