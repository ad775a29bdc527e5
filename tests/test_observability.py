"""Watching a real `kvpilot serve`: what /metrics and /v1/sessions export, `kvpilot top`
against it, and the Grafana dashboard and Prometheus config shipped in deploy/."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvpilot.policy.breakeven import PauseAction
from kvpilot.server.process import ServeProcess
from kvpilot.top import view
from kvpilot.top.sample import parse_metrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvpilot.json"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
METRIC = re.compile(r"\bkvpilot_[a-z0-9_]+\b")
SESSIONS = 2


KEY = "k-alice"
AUTH = {"Authorization": f"Bearer {KEY}"}


def drive(url: str, headers: dict[str, str] | None = None) -> None:
    """Two agent sessions of two turns, each turn ending on a tool call; one plain request."""
    with httpx.Client(base_url=url, timeout=120.0, headers=headers) as client:
        for k in range(SESSIONS):
            sid = client.post("/v1/sessions").json()["id"]
            for turn in range(2):
                body = {
                    "prompt": f"agent {k} turn {turn}: " + "read the file, run the tests. " * 12,
                    "max_tokens": 4,
                    "session_id": sid,
                    "session_history": "append",
                    "expected_tool_wait_s": 30.0,
                    "tool": "pytest",
                }
                client.post("/v1/completions", json=body).raise_for_status()
        client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}).raise_for_status()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{KEY} alice\nk-bob bob\n")
    args = ["--kv-blocks", "128", "--host-memory", "8MiB", "--max-model-len", "2048"]
    with ServeProcess([*args, "--api-keys", str(keys)]) as srv:
        drive(srv.base_url, AUTH)
        yield srv


@pytest.fixture(scope="module")
def exported(server: ServeProcess) -> dict[str, Any]:
    """The sample names and values the server's /metrics exports after the traffic."""
    time.sleep(0.3)  # the engine thread publishes a snapshot after its next iteration
    return parse_metrics(httpx.get(f"{server.base_url}/metrics", timeout=30).text)


def value(exported: dict[str, Any], name: str, **labels: str) -> float:
    return exported[name][tuple(sorted(labels.items()))]


def test_metrics_export_tau_high_sessions_by_state_and_the_ideal(exported: dict) -> None:
    assert value(exported, "kvpilot_tau_high_ratio") == pytest.approx(0.9)
    assert value(exported, "kvpilot_sessions", state="paused") == SESSIONS
    for state in ("running", "waiting", "idle"):
        assert value(exported, "kvpilot_sessions", state=state) == 0
    prompt = value(exported, "kvpilot_prompt_tokens_total")
    cached = value(exported, "kvpilot_cached_prompt_tokens_total")
    ideal = value(exported, "kvpilot_ideal_cached_prompt_tokens_total")
    assert 0 < cached <= ideal < prompt  # each second turn reuses its first turn's context


def test_the_sessions_list_says_what_each_session_does_and_why_it_paused(
    server: ServeProcess,
) -> None:
    listed = httpx.get(f"{server.base_url}/v1/sessions", headers=AUTH, timeout=30).json()
    assert listed["object"] == "list" and len(listed["data"]) == SESSIONS
    for session in listed["data"]:
        assert session["state"] == "paused" and session["turns"] == 2
        pause = session["last_pause"]
        assert pause["tool"] == "pytest" and pause["expected_wait_s"] == 30.0
        assert pause["reason"].startswith(PauseAction(pause["action"]).label)
        assert time.time() - 600 < pause["decided_at"] <= time.time()


def run_top(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "100"}
    return subprocess.run(
        [sys.executable, "-m", "kvpilot.cli", "top", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_top_shows_a_live_server(server: ServeProcess) -> None:
    args = ("--url", server.base_url, "--api-key", KEY, "--iterations", "2", "--interval", "0.3")
    result = run_top(*args)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("kvpilot top · ") == 2  # two refreshes
    frame = out[out.rindex("kvpilot top · ") :]
    for shown in (
        "model tiny · policy breakeven · engine running",
        "tau_high 0.90",
        "device",
        "host",
        "disk",
        "not configured",  # no --disk-dir
        f"paused {SESSIONS}",
        "hit rate",
        "ideal (unbounded cache)",
        "prefetch",
        "KV moved",
        "Last pause decisions",
        "pytest · 30.0 s",
        "(now paused)",
    ):
        assert shown in frame, shown
    assert re.search(r"\b(Retain|Offload to host|Offload to disk|Drop)\b", frame)
    assert max(len(line) for line in out.splitlines()) <= 100


def test_top_says_when_no_server_answers() -> None:
    result = run_top("--url", "http://127.0.0.1:9", "--iterations", "1")
    assert result.returncode == 2
    assert "cannot read http://127.0.0.1:9" in result.stderr and "kvpilot serve" in result.stderr


def test_top_without_the_servers_api_key_says_which_flag_it_needs(server: ServeProcess) -> None:
    refused = run_top("--url", server.base_url, "--iterations", "1")
    assert refused.returncode == 2 and "--api-key" in refused.stderr


def test_another_tenant_sees_none_of_these_sessions(server: ServeProcess) -> None:
    bob = httpx.get(f"{server.base_url}/v1/sessions", headers={"Authorization": "Bearer k-bob"})
    assert bob.status_code == 200 and bob.json()["data"] == []


def test_the_usage_bar_marks_tau_high_and_turns_red_above_it() -> None:
    below, above = view.usage_bar(0.5, 0.9, width=10), view.usage_bar(0.95, 0.9, width=10)
    assert below.plain == "█████░░░░|" and above.plain == "█████████|"  # | at 90%
    assert "red" not in str(below.spans) and "red" in str(above.spans)


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def test_every_dashboard_query_names_a_metric_the_server_exports(exported: dict) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queried = set()
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs, f"panel {panel['title']!r} has no query"
        for expr in exprs:
            names = set(METRIC.findall(expr))
            assert names, f"{panel['title']!r}: {expr!r} names no kvpilot metric"
            missing = names - set(exported)
            assert not missing, f"{panel['title']!r} queries {missing}, not exported"
            queried |= names
    # The dashboard covers what `kvpilot top` shows.
    shown_by_top = set(METRIC.findall(Path(view.__file__).read_text()))
    assert shown_by_top <= queried, shown_by_top - queried


def test_dashboard_panels_are_laid_out_without_overlaps() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    cells: set[tuple[int, int]] = set()
    ids = []
    for panel in panels(dashboard):
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        ids.append(panel["id"])
    assert len(ids) == len(set(ids))


def test_the_prometheus_config_scrapes_kvpilot_metrics() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kvpilot"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"]


def test_serve_logs_its_banner_line_by_line_before_it_accepts_requests(
    server: ServeProcess,
) -> None:
    assert server.log_path is not None
    log = server.log_path.read_text()
    steps = [
        "kvpilot serve: model tiny on cpu (float32)",
        "loading PyTorch",
        "PyTorch ",
        "model: ",
        "loading the tokenizer",
        "loading weights: ",
        "weights loaded in ",
        "KV pool: 128 blocks of 16 tokens (2,048 tokens), 8.4 MB on cpu",
        "host tier: 128 blocks, 8.4 MB, link ",
        "disk tier: none (--disk-dir adds one)",
        "pause policy: breakeven: retain, offload or drop each pause",
        "admission: new work while device KV use is under tau_high 0.90",
        "ready in ",
        f"{server.base_url} (OpenAI API under /v1, /metrics, /health)",
        "Application startup complete",  # uvicorn: from here on it accepts requests
    ]
    at = 0
    for step in steps:
        found = log.find(step, at)
        assert found >= 0, f"{step!r} missing or out of order in:\n{log}"
        at = found
