"""A failing disk (full, I/O errors) costs speed, never a request: writes become "not stored",
counted and logged once per episode, and nothing reaches the engine loop."""

from __future__ import annotations

import errno
import logging
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpilot.engine import Engine
from kvpilot.errors import ConfigError
from kvpilot.server import create_app
from kvpilot.server.background import BackgroundServer
from kvpilot.store import DiskBlockStore, SessionStore

BLOCK = 64
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 4}


class FullDisk:
    """Makes a store's writes fail as a full disk does: SQLite's "database or disk is full"
    and ENOSPC from the data file. Undone by ``heal``."""

    def __init__(self) -> None:
        self.undo: list[tuple[object, str, object]] = []

    def _patch(self, obj: object, name: str, value: object) -> None:
        self.undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def break_sessions(self, store: SessionStore) -> None:
        self._patch(store, "_conn", _FullConnection(store._conn))

    def break_blocks(self, store: DiskBlockStore) -> None:
        def no_space(*args: object, **kwargs: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        def index_full(*args: object, **kwargs: object) -> None:
            raise sqlite3.OperationalError("database or disk is full")

        self._patch(store._file, "write", no_space)
        self._patch(store._index, "commit", index_full)

    def heal(self) -> None:
        for obj, name, value in reversed(self.undo):
            setattr(obj, name, value)
        self.undo.clear()


class _FullConnection:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def execute(self, sql: str, *args: Any) -> Any:
        if sql.lstrip().upper().startswith(("INSERT", "DELETE", "UPDATE")):
            raise sqlite3.OperationalError("database or disk is full")
        return self.conn.execute(sql, *args)

    def close(self) -> None:
        self.conn.close()


def test_block_writes_index_commits_and_close_survive_a_full_disk(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = DiskBlockStore(tmp_path, num_slots=8, block_bytes=BLOCK)
    disk = FullDisk()
    disk.break_blocks(store)
    with caplog.at_level(logging.WARNING, logger="kvpilot.store.disk"):
        results = [store.put(bytes([i]) * 16, b"x" * BLOCK).result() for i in range(5)]
        store.flush()
    assert results == [False] * 5
    assert store.stats.write_errors == 5 and store.faults.failures == 5
    assert len(caplog.records) == 1, [r.message for r in caplog.records]  # once per episode
    store.check_invariants()
    disk.heal()
    assert store.put(b"k" * 16, b"y" * BLOCK).result() is True
    assert store.get(b"k" * 16) == b"y" * BLOCK
    disk.break_blocks(store)
    store.close()  # the final index commit fails too: close still closes


def test_session_saves_on_a_full_disk_return_false(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    disk = FullDisk()
    disk.break_sessions(store)
    assert store.save("s1", [1, 2, 3], None, {}) is False
    assert store.delete("s1") is False
    assert store.faults.failures == 2
    disk.heal()
    assert store.save("s1", [1, 2, 3], None, {}) is True
    assert store.load("s1") is not None
    store.close()


def test_a_disk_tier_larger_than_the_free_space_is_refused(tmp_path: Path) -> None:
    import shutil

    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ConfigError, match="--disk-blocks"):
        DiskBlockStore(tmp_path, num_slots=2 * free // (1 << 20) + 1, block_bytes=1 << 20)
    assert not (tmp_path / "blocks.dat").exists()


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[tuple[httpx.Client, Engine]]:
    engine = Engine.from_pretrained(
        "tiny", kv_blocks=64, max_model_len=512, disk_dir=str(tmp_path), pause_policy="offload-disk"
    )
    with (
        BackgroundServer(create_app(engine, model_name="tiny")) as srv,
        httpx.Client(base_url=srv.base_url, timeout=60) as http,
    ):
        yield http, engine


def test_a_full_disk_does_not_stop_the_engine(server: tuple[httpx.Client, Engine]) -> None:
    http, engine = server
    offload = engine.offload
    assert offload.disk is not None and offload.session_store is not None
    disk = FullDisk()
    disk.break_blocks(offload.disk)
    disk.break_sessions(offload.session_store)
    sid = http.post("/v1/sessions").json()["id"]
    prompt = "a long enough prompt to fill a few blocks of sixteen tokens each, " * 2
    for turn in range(3):
        body = {"prompt": prompt if turn == 0 else " and on", "session_id": sid, **GREEDY}
        response = http.post("/v1/completions", json={**body, "expected_tool_wait_s": 5.0})
        assert response.status_code == 200, response.text
        assert response.json()["kvpilot"]["pause"]["action"] == "offload_disk"
    assert http.get("/health").status_code == 200
    metrics = http.get("/metrics").text
    assert 'kvpilot_disk_write_errors_total{what="sessions"} 3.0' in metrics
    assert offload.disk.faults.failures > 0
    disk.heal()
    response = http.post(
        "/v1/completions",
        json={"prompt": " again", "session_id": sid, "expected_tool_wait_s": 5.0, **GREEDY},
    )
    assert response.status_code == 200, response.text
    assert sid in offload.session_store  # saved again once the disk has room


def test_offload_disk_without_a_host_tier_frees_the_device(tmp_path: Path) -> None:
    """Device -> disk directly: the session's blocks land on disk and leave the device (no
    immediate load back: the reload estimate must be finite without a host tier)."""
    engine = Engine.from_pretrained(
        "tiny", kv_blocks=64, max_model_len=512, disk_dir=str(tmp_path), pause_policy="offload-disk"
    )
    with (
        BackgroundServer(create_app(engine, model_name="tiny")) as srv,
        httpx.Client(base_url=srv.base_url, timeout=60) as http,
    ):
        sid = http.post("/v1/sessions").json()["id"]
        prompt = "a prompt long enough to fill several blocks of sixteen tokens: " * 3
        turn = {"prompt": prompt, "session_id": sid, "expected_tool_wait_s": 60.0, **GREEDY}
        response = http.post("/v1/completions", json=turn)
        assert response.status_code == 200, response.text
        pause = response.json()["kvpilot"]["pause"]
        assert pause["action"] == "offload_disk"
        deadline = time.monotonic() + 20
        while True:
            blocks = http.get(f"/v1/sessions/{sid}").json()["blocks"]
            if (blocks["disk"] and not blocks["device"]) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert blocks["disk"] >= blocks["full_blocks"] - 1 > 0, blocks
        assert blocks["device"] == 0 and blocks["held_on_device"] == 0, blocks
        time.sleep(1.0)  # and it stays off the device until the agent comes back
        assert http.get(f"/v1/sessions/{sid}").json()["blocks"]["device"] == 0
        again = {"prompt": " next", "session_id": sid, **GREEDY}
        resumed = http.post("/v1/completions", json=again).json()
        assert resumed["kvpilot"]["cached_tokens_by_tier"]["disk"] > 0
