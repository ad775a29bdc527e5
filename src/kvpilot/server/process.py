"""Run the real ``kvpilot serve`` command in a child process on a free loopback port.

``with ServeProcess(["--kv-blocks", "256"]) as server: ... server.base_url ...`` starts the
command, waits until ``/health`` answers ok (passing each line the server logs meanwhile,
its start-up banner, to ``on_log``), and on the way out (an error or Ctrl-C
included) stops it the way a user would: SIGINT (uvicorn's graceful shutdown, which
closes the engine and its disk tier), then SIGTERM, then SIGKILL, each after a grace period.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from kvpilot.errors import KvpilotError


class ServerStartError(KvpilotError):
    """``kvpilot serve`` exited or never became healthy; the message ends with its log."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ServeProcess:
    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 180.0,
        stop_timeout_s: float = 20.0,
        log_path: Path | None = None,
        on_log: Callable[[str], None] | None = None,
    ) -> None:
        self.args = list(args)
        self.on_log = on_log
        self._log_offset = 0
        self.host = host
        self.port = 0
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_path = log_path
        self.health: dict[str, Any] = {}
        self.returncode: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kvpilot.cli",
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.args,
        ]

    def start(self) -> None:
        self.port = free_port(self.host)
        self._log_offset = 0
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="kvpilot-serve-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log = self.log_path.open("wb")
        # Its own session: a Ctrl-C at the terminal reaches only us, and we stop it in order.
        self._proc = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(base_url=self.base_url, timeout=5.0) as client:
            while True:
                self._pass_on_log()
                code = self._proc.poll()
                if code is not None:
                    raise ServerStartError(
                        f"kvpilot serve exited with status {code} before it was ready; "
                        f"its log:\n{self.log_tail()}"
                    )
                try:
                    response = client.get("/health")
                    if response.status_code == 200:
                        self.health = response.json()
                        self._pass_on_log()
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"kvpilot serve did not answer /health within "
                        f"{self.startup_timeout_s:.0f} s; its log:\n{self.log_tail()}"
                    )
                time.sleep(0.2)

    def _pass_on_log(self) -> None:
        """Hand the log's new complete lines to ``on_log``."""
        if self.on_log is None or self.log_path is None:
            return
        with self.log_path.open("rb") as f:
            f.seek(self._log_offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._log_offset += end
        for line in data[:end].decode("utf-8", errors="replace").splitlines():
            self.on_log(line)

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> int | None:
        """Stop the server (idempotent); its exit status, or None if it was never started."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            for sig in (signal.SIGINT, signal.SIGTERM):
                proc.send_signal(sig)
                try:
                    proc.wait(self.stop_timeout_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            else:
                proc.kill()
                proc.wait()
        if proc is not None:
            self.returncode = proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.returncode

    def __enter__(self) -> ServeProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
