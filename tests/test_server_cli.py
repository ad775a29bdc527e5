"""`kvpilot serve` options: validated, passed to the engine or reported by /health."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from kvpilot.errors import ConfigError
from kvpilot.server import cli_serve
from kvpilot.server.cli_serve import ServeOptions, build_app, serve


def test_kv_memory_and_kv_blocks_are_mutually_exclusive() -> None:
    with pytest.raises(ConfigError, match="not both"):
        ServeOptions(kv_memory_bytes=1 << 20, kv_blocks=4)


def test_an_unknown_pause_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="breakeven"):
        ServeOptions(policy="yolo")


def test_a_disk_dir_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="disk-dir"):
        ServeOptions(disk_dir=blocker / "sub")


def test_tier_options_are_reported_by_health(tmp_path: Path) -> None:
    options = ServeOptions(
        kv_blocks=64, host_memory_bytes=1 << 30, disk_dir=tmp_path / "kv", max_num_seqs=8
    )
    with TestClient(build_app(options)) as client:
        health = client.get("/health").json()
    assert health["status"] == "ok"
    assert health["kv"]["device"]["blocks"] == 64
    reported = health["options"]
    assert reported["host_memory_bytes"] == 1 << 30
    assert reported["disk_dir"] == str(tmp_path / "kv")
    assert reported["policy"] == "breakeven"
    assert reported["tiers_applied"] or "not take them yet" in reported["note"]


def cli() -> typer.Typer:
    app = typer.Typer()
    app.command()(serve)
    return app


def test_the_serve_command_builds_the_app_and_runs_uvicorn(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: dict[str, Any] = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: calls.update(app=app, **kw))
    keys = tmp_path / "keys.txt"
    keys.write_text("k1 alice\n")
    args = ["--kv-memory", "4MiB", "--port", "8123", "--api-keys", str(keys), "--max-n", "2"]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 0, result.output
    assert calls["port"] == 8123 and calls["host"] == "127.0.0.1"
    state = calls["app"].state.kvpilot
    assert state.api_keys.tenants == {"alice"} and state.limits.max_n == 2
    state.engine.shutdown()


def test_bad_serve_options_exit_with_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_serve, "build_app", lambda options: pytest.fail("must not build"))
    result = CliRunner().invoke(cli(), ["--kv-memory", "1GiB", "--kv-blocks", "4"])
    assert result.exit_code != 0
    assert "not both" in result.output
