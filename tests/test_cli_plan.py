from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvpilot.cli import app
from kvpilot.errors import ConfigError
from kvpilot.units import parse_bytes

runner = CliRunner()


def test_plan_napkin_math_0_1_at_tp_8() -> None:
    result = runner.invoke(app, ["plan", "--tp", "8"])
    assert result.exit_code == 0, result.output
    out = result.output
    for figure in ("327,680", "40,960", "687.2", "141.2", "526.0", "195", "48", "12"):
        assert figure in out
    assert "cold (eq. 6)" in out and "shared (eq. 7)" in out
    assert "tail waste (%)" in out and "0.12" in out


def test_plan_json_is_one_object_with_every_figure() -> None:
    result = runner.invoke(app, ["plan", "--json", "--tp", "8"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["footprint"]["model_bytes"] == 327_680
    assert round(plan["budget"]["pool_bytes_node"] / 1e9, 1) == 526.0
    assert [row["cold"] for row in plan["capacity"]] == [195, 48, 12]
    assert [row["shared"] for row in plan["capacity"]] == [None, 192, 14]
    assert plan["blocks"][0]["num_blocks"] > 0
    assert plan["pauses"] == []


def test_plan_napkin_0_7_from_the_command_line() -> None:
    args = ["plan", "--json", "--tp", "8", "--hbm", "80GB", "--weights", "140GB"]
    args += ["--reserve", "4.5GB"]
    args += ["--headroom", "0.1", "--context", "32768", "--output", "2048"]
    plan = json.loads(runner.invoke(app, args).output)
    assert plan["capacity"] == [
        {"context_tokens": 32768, "trajectory_bytes": 32768 * 327_680, "cold": 36, "shared": 122}
    ]


def test_plan_pause_prices_the_45_second_wait() -> None:
    result = runner.invoke(app, ["plan", "--pause", "45", "--context", "32768"])
    assert result.exit_code == 0, result.output
    assert "offload to host" in result.output  # the action, in words
    assert "Offload to host: the 45.0 s wait" in result.output  # the reason leads with it
    assert "62x faster" in result.output
    assert "483" in result.output


def test_plan_pause_json_carries_the_decision() -> None:
    result = runner.invoke(app, ["plan", "--json", "--pause", "45", "--context", "32768"])
    (row,) = json.loads(result.output)["pauses"]
    assert row["decision"]["action"] == "offload_host"
    assert row["decision"]["reload_vs_recompute"] == pytest.approx(62, abs=0.5)


def test_plan_reads_a_config_json(tmp_path: Path) -> None:
    config = {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = runner.invoke(app, ["plan", "--json", "--model", str(path), "--node", "1xh100"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["footprint"]["model_bytes"] == 131_072
    assert plan["budget"]["weight_bytes_per_device"] == pytest.approx(16.06e9, rel=0.01)


def test_plan_with_an_unknown_preset_fails_with_the_list_of_presets() -> None:
    result = runner.invoke(app, ["plan", "--model", "gpt-5"])
    assert result.exit_code != 0
    assert "unknown model 'gpt-5'" in result.output
    assert "llama-3-70b" in result.output


def test_plan_with_a_bad_size_fails_with_a_hint() -> None:
    result = runner.invoke(app, ["plan", "--reserve", "20XB"])
    assert result.exit_code != 0
    assert "cannot read --reserve '20XB'" in result.output


@pytest.mark.parametrize("flag", ["--hbm", "--reserve", "--weights", "--link-bw", "--nvme-bw"])
def test_a_size_without_a_unit_is_an_error_naming_the_units(flag: str) -> None:
    result = runner.invoke(app, ["plan", flag, "80"])
    assert result.exit_code == 2
    assert f"{flag} '80' has no unit: write e.g. 80GB or 80GiB" in result.output
    assert "KiB, MiB, GiB, TiB" in result.output


def test_plan_default_tp_is_the_smallest_that_fits_and_says_so() -> None:
    result = runner.invoke(app, ["plan", "--model", "qwen2.5-7b"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "TP 1 x 8 replicas" in out
    assert "TP 1: the smallest whose weights leave room for a 131,072-token sequence" in out
    assert "KV per token (eq. 1, whole model): 57,344 B" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--kv-dtype", "int4"],
            "--kv-dtype: unknown KV dtype 'int4': use one of bf16, fp16, fp32, fp8",
        ),
        (
            ["--weights-dtype", "fp4"],
            "--weights-dtype: unknown weights dtype 'fp4': use one of bf16",
        ),
        (["--node", "8xtpu"], "--node: unknown accelerator 'tpu': use one of a100-40"),
        (["--tp", "3"], "tensor parallel degree 3 must divide the 8 accelerators"),
        (["--pause", "soon"], "cannot read --pause 'soon'"),
        (["--headroom", "1.5"], "--headroom is a fraction in [0, 1)"),
    ],
)
def test_plan_mistakes_name_the_flag_and_the_accepted_values(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["plan", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_plan_of_a_hybrid_fp32_config_says_what_it_assumed(tmp_path: Path) -> None:
    config = {
        "model_type": "gemma2",
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_attention_heads": 16,
        "num_hidden_layers": 42,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "vocab_size": 256000,
        "sliding_window": 4096,
        "max_position_embeddings": 8192,
        "torch_dtype": "float32",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = runner.invoke(app, ["plan", "--model", str(path), "--node", "1xh200"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "21 full-attention + 21 sliding-window (4,096 tokens) layers" in out
    assert "KV per token (eq. 1, whole model): 688,128 B" in out
    assert "full-attention layers 344,064 B per token" in out
    assert "exceed" in out and "limit of 8,192 tokens" in out
    assert "KV cache in fp32" in out


def test_frag_default_compares_allocators_and_reproduces_napkin_0_2() -> None:
    result = runner.invoke(app, ["frag"])
    assert result.exit_code == 0, result.output
    out = result.output
    for name in ("static", "buddy", "paged", "12.5", "100.0", "refused"):
        assert name in out
    assert "512, 256, 1,024, 768, 1,024 MiB" in out


def test_frag_json_is_one_object() -> None:
    result = runner.invoke(app, ["frag", "--json", "--rounds", "20"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert [r["allocator"] for r in payload["allocators"]] == ["static", "buddy", "paged"]
    scenario_b = payload["spec_napkin_0_2"][1]
    assert scenario_b["snapshot"]["phi_ext"] == 1.0


def test_frag_with_bad_lengths_fails_with_a_hint() -> None:
    result = runner.invoke(app, ["frag", "--lengths", "10,x"])
    assert result.exit_code != 0
    assert "--lengths takes integers" in result.output


@pytest.mark.parametrize(
    ("text", "value"),
    [("20GB", 20e9), ("2.5GiB", 2.5 * 2**30), ("640KiB", 640 * 1024), ("64GB/s", 64e9), ("7B", 7)],
)
def test_sizes_read_decimal_and_binary_units(text: str, value: float) -> None:
    assert parse_bytes(text) == value


def test_size_without_a_known_unit_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"20GB, 2\.5GiB"):
        parse_bytes("twenty")
