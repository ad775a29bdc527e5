"""The first hour with the CLI: instant help, flags that read as flags, words a newcomer
understands, tables that fit a terminal, and mistakes caught before any work."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvpilot.cli import app
from kvpilot.cli import sim as cli_sim
from kvpilot.cli.checks import check_checkpoint
from kvpilot.errors import ConfigError

runner = CliRunner()
HEAVY = ("fastapi", "torch", "matplotlib", "transformers", "numpy", "uvicorn", "openai")
WIDE = {"COLUMNS": "100"}


def test_importing_the_cli_loads_nothing_heavy() -> None:
    code = (
        "import json, sys\n"
        "import kvpilot.cli\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_help_lists_every_command_and_renders_flags_as_flags() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("plan", "frag", "demo", "serve", "top", "sim", "calibrate", "trace"):
        assert command in result.output
    assert "<bool>" not in result.output
    plan_help = runner.invoke(app, ["plan", "--help"]).output
    assert re.search(r"--json\s+Print one JSON object", plan_help), plan_help
    assert "<bool>" not in plan_help and "<int>" in plan_help  # valued options keep their type


def test_a_flag_given_a_value_is_refused_by_its_name() -> None:
    result = runner.invoke(app, ["plan", "--json=yes"])
    assert result.exit_code == 2
    assert "--json" in result.output


@pytest.mark.parametrize("args", [[], ["trace"]])
def test_a_group_without_a_command_prints_its_help_and_succeeds(args: list[str]) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 0
    assert "Usage:" in result.output and "Commands" in result.output


def lines_of(output: str) -> list[str]:
    return output.splitlines()


@pytest.mark.parametrize(
    "args",
    [["plan", "--pause", "45"], ["plan", "--model", "deepseek-v3", "--node", "8xb200"], ["frag"]],
)
def test_tables_fit_100_columns_without_cutting_words(args: list[str]) -> None:
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in lines_of(result.output)) <= 100
    assert "…" not in result.output


def test_frag_explains_each_measure_with_the_spec_symbol_in_parentheses() -> None:
    out = runner.invoke(app, ["frag", "--rounds", "5"], env=WIDE).output
    assert "allocation efficiency (η_alloc)" in out
    assert "external fragmentation (Φ_ext)" in out
    assert "effective efficiency (η_effective)" in out
    for symbol in ("η_alloc", "Φ_ext", "η_effective"):
        assert out.count(symbol) == out.count(f"({symbol})"), symbol  # never bare jargon
    assert "Napkin Math 0.2" not in out.replace("(Napkin Math 0.2)", "")


def test_a_demo_with_an_unknown_model_fails_before_any_work() -> None:
    result = runner.invoke(app, ["demo", "--model", "X"])
    assert result.exit_code == 2
    assert "--model 'X'" in result.output and "tiny" in result.output
    assert "kvpilot plan" not in result.output  # plan and frag never ran
    assert "python -m kvpilot.cli" not in result.output


def test_serve_refuses_a_bad_model_before_loading_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from kvpilot.cli import app\n"
        f"r = CliRunner().invoke(app, ['serve', '--model', {str(tmp_path / 'nope')!r}])\n"
        "print(r.exit_code, 'torch' in sys.modules, 'fastapi' in sys.modules)\n"
        "print(r.output)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    first, message = out.stdout.split("\n", 1)
    assert first == "2 False False"
    assert "--model" in message and "'tiny'" in message and "Usage" not in message


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--dtype", "float8"], "--dtype"),
        (["--device", "tpu"], "--device"),
        (["--policy", "yolo"], "--policy"),
        (["--kv-memory", "lots"], "--kv-memory"),
    ],
)
def test_serve_names_the_flag_and_its_accepted_values(args: list[str], flag: str) -> None:
    result = runner.invoke(app, ["serve", *args])
    assert result.exit_code == 2
    assert flag in result.output, result.output


def test_a_checkpoint_folder_is_checked_from_its_config_alone(tmp_path: Path) -> None:
    check_checkpoint("tiny")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="--model"):
        check_checkpoint(str(tmp_path))


def test_a_folder_without_weights_is_refused(hf_checkpoint: Any, tmp_path: Path) -> None:
    source = hf_checkpoint("llama")
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    check_checkpoint(str(source))
    with pytest.raises(ConfigError, match="safetensors"):
        check_checkpoint(str(tmp_path))


SIM = ["sim", "--model", "llama-3-8b", "--node", "h100", "--kv-blocks", "3000"]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--model", "gpt-9"], "--model"),
        (["--node", "3xabacus"], "--node"),
        (["--policy", "fastest"], "--policy"),
        (["--compare-policies", "--policies", "retain,fastest"], "--policies"),
        (["--duration", "soon"], "--duration"),
    ],
)
def test_sim_checks_its_options_before_building_anything(
    monkeypatch: pytest.MonkeyPatch, args: list[str], flag: str
) -> None:
    def never(*a: object, **k: object) -> None:
        pytest.fail("loaded a workload before checking the options")

    monkeypatch.setattr("kvpilot.sim.workload.WorkloadConfig.default", never)
    result = runner.invoke(app, [*SIM, *args])
    assert result.exit_code == 2
    assert f"error: {flag}" in result.output, result.output


def test_compare_policies_shows_which_policy_of_how_many(monkeypatch: pytest.MonkeyPatch) -> None:
    labels: list[str] = []

    class Recorder:
        def __init__(self, console: object, total_s: float, label: str, quiet: bool) -> None:
            labels.append(label)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(cli_sim, "_progress", Recorder)
    args = [*SIM, "--duration", "5s", "--compare-policies", "--policies", "retain,drop"]
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == 0, result.output
    assert labels == ["policy 1/3: breakeven", "policy 2/3: retain", "policy 3/3: drop"]
    comparison = result.output[result.output.index("policy comparison") :]
    assert max(len(line) for line in lines_of(comparison)) <= 100
    assert "…" not in comparison


def test_the_dtypes_serve_accepts_are_the_ones_the_model_runner_takes() -> None:
    from kvpilot.cli.checks import DTYPE_NAMES
    from kvpilot.model.runner import DTYPES

    assert set(DTYPE_NAMES) == set(DTYPES)
