"""`kvpilot serve` options: validated, passed to the engine or reported by /health."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from kvpilot.cli import serve as cli_serve
from kvpilot.cli.serve import ServeOptions, build_app, serve
from kvpilot.engine.config import EngineConfig
from kvpilot.errors import ConfigError
from kvpilot.policy.pause import POLICY_NAMES


def options(**flat: object) -> ServeOptions:
    return ServeOptions(engine=EngineConfig.from_kwargs(**flat))


def test_kv_memory_and_kv_blocks_are_mutually_exclusive() -> None:
    with pytest.raises(ConfigError, match="not both"):
        options(kv_memory_bytes=1 << 20, kv_blocks=4)


def test_an_unknown_pause_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="breakeven"):
        options(pause_policy="yolo")


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_engine_pause_policy_is_accepted(policy: str) -> None:
    assert options(pause_policy=policy).engine.pause.policy == policy


def test_a_disk_dir_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="disk-dir"):
        options(disk_dir=str(blocker / "sub"))


def test_disk_blocks_need_a_disk_dir() -> None:
    with pytest.raises(ConfigError, match="--disk-dir"):
        options(disk_kv_blocks=64)


def test_tier_options_build_an_engine_with_those_tiers(tmp_path: Path) -> None:
    serve_options = options(
        kv_blocks=64,
        host_memory_bytes=1 << 22,
        disk_dir=str(tmp_path / "kv"),
        disk_kv_blocks=100,
        pause_policy="offload-disk",
        max_num_seqs=8,
    )
    app = build_app(serve_options)
    engine = app.state.kvpilot.engine.engine
    assert engine.config.pause.policy == "offload-disk"
    block_bytes = engine.offload.block_bytes
    assert engine.offload.host_pool.num_blocks == (1 << 22) // block_bytes
    assert engine.offload.disk is not None and engine.offload.disk.num_slots == 100
    with TestClient(app) as client:
        health = client.get("/health").json()
    assert health["status"] == "ok"
    assert health["kv"]["device"]["blocks"] == 64
    assert health["kv"]["host"]["blocks"] == (1 << 22) // block_bytes
    assert health["kv"]["disk"]["blocks"] == 100
    tiers = health["tiers"]
    assert tiers["policy"] == "offload-disk"
    assert tiers["host"]["enabled"] and tiers["host"]["bytes"] <= 1 << 22
    assert tiers["disk"] == {**tiers["disk"], "enabled": True, "dir": str(tmp_path / "kv")}
    assert health["options"]["host_memory_bytes"] == 1 << 22


def test_without_tier_options_only_the_device_tier_exists() -> None:
    with TestClient(build_app(options(kv_blocks=32))) as client:
        tiers = client.get("/health").json()["tiers"]
    assert tiers["policy"] == "breakeven"
    assert not tiers["host"]["enabled"] and not tiers["disk"]["enabled"]


def test_shutdown_closes_the_engine_and_releases_the_disk_tier(tmp_path: Path) -> None:
    from kvpilot.store import DiskBlockStore

    app = build_app(options(kv_blocks=32, disk_dir=str(tmp_path / "kv"), disk_kv_blocks=8))
    block_bytes = app.state.kvpilot.engine.engine.offload.block_bytes
    with TestClient(app), pytest.raises(ConfigError, match="already open"):
        DiskBlockStore(tmp_path / "kv", 8, block_bytes)
    DiskBlockStore(tmp_path / "kv", 8, block_bytes).close()  # the server's store let go of it


def cli() -> typer.Typer:
    app = typer.Typer()
    app.command()(serve)
    return app


def test_the_serve_command_builds_the_app_and_runs_uvicorn(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: dict[str, Any] = {}

    def run(server: Any) -> None:  # uvicorn, as `kvpilot serve` runs it, not started
        config = server.config
        calls.update(app=config.app, host=config.host, port=config.port)
        calls["grace_s"] = config.timeout_graceful_shutdown

    monkeypatch.setattr("kvpilot.server.ops.GracefulServer.run", run)
    keys = tmp_path / "keys.txt"
    keys.write_text("k1 alice\n")
    args = ["--kv-memory", "4MiB", "--port", "8123", "--api-keys", str(keys), "--max-n", "2"]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 0, result.output
    assert calls["port"] == 8123 and calls["host"] == "127.0.0.1" and calls["grace_s"] == 30
    state = calls["app"].state.kvpilot
    assert state.api_keys.tenants == {"alice"} and state.limits.max_n == 2
    state.engine.shutdown()


def test_bad_serve_options_exit_with_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        cli_serve, "build_app", lambda options, banner=None: pytest.fail("must not build")
    )
    result = CliRunner().invoke(cli(), ["--kv-memory", "1GiB", "--kv-blocks", "4"])
    assert result.exit_code != 0
    assert "not both" in result.output
    result = CliRunner().invoke(cli(), ["--tp", "0"])
    assert result.exit_code != 0
    assert "--tp" in result.output and ">= 1" in result.output


def option_names(command: object) -> set[str]:
    app = typer.Typer()
    app.command()(command)  # type: ignore[arg-type]
    click_command = typer.main.get_command(app)
    return {opt for p in click_command.params for opt in getattr(p, "opts", [])}


def test_serve_and_sim_share_flag_names() -> None:
    from kvpilot.cli.sim import sim

    shared = {
        "--model",
        "--kv-blocks",
        "--block-size",
        "--max-batched-tokens",
        "--prefill-chunk",
        "--max-num-seqs",
        "--tau-high",
        "--max-model-len",
        "--host-memory",
        "--policy",
        "--tp",
    }
    assert shared <= option_names(serve) & option_names(sim)


def test_scheduler_and_pool_flags_reach_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[ServeOptions] = []

    def fake_build(options: ServeOptions, banner: object = None) -> object:
        built.append(options)
        raise typer.Exit(0)

    monkeypatch.setattr(cli_serve, "build_app", fake_build)
    args = ["--block-size", "32", "--max-batched-tokens", "512", "--prefill-chunk", "128"]
    args += ["--tau-high", "0.8", "--host-memory", "64MiB", "--kv-blocks", "100", "--tp", "2"]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 0, result.output
    config = built[0].engine
    assert config.runner.block_size == 32 and config.runner.kv_blocks == 100
    assert config.runner.tensor_parallel_size == 2
    assert config.runner.tiers.host_memory_bytes == 64 << 20
    assert config.scheduler.max_num_batched_tokens == 512
    assert config.scheduler.max_prefill_chunk == 128 and config.scheduler.tau_high == 0.8
