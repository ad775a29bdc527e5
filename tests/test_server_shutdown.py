"""`kvpilot serve` stops within --shutdown-timeout on SIGTERM and SIGINT alike, with a long
stream in flight, and exits 0 after closing its disk tier."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvpilot.server.process import ServeProcess

SHUTDOWN_TIMEOUT_S = 2.0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_shutdown_is_bounded_by_the_timeout(sig: signal.Signals, tmp_path: Path) -> None:
    args = ["--kv-blocks", "128", "--disk-dir", str(tmp_path)]
    server = ServeProcess([*args, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)])
    with server:
        streamed: list[str] = []
        body = {"prompt": "once upon a time", "max_tokens": 1900, "ignore_eos": True}

        def stream() -> None:
            try:
                with httpx.stream(
                    "POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}
                ) as response:
                    for line in response.iter_lines():
                        streamed.append(line)
            except httpx.HTTPError:
                pass

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        deadline = time.monotonic() + 60
        while len(streamed) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(streamed) >= 3, "the stream never started"
        proc = server._proc
        assert proc is not None
        ready = httpx.get(f"{server.base_url}/ready")
        assert ready.status_code == 200
        start = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 20)
        took = time.monotonic() - start
        client.join(10)
    assert code == 0, server.log_tail()
    assert took < SHUTDOWN_TIMEOUT_S + 15, took
    assert "data: [DONE]" not in streamed  # it was cut off, not run to the end
    assert (tmp_path / "index.sqlite3").exists()
