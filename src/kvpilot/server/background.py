"""Run an app with uvicorn in a background thread on a free loopback port (tests, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn
from fastapi import FastAPI


class BackgroundServer:
    """``with BackgroundServer(app) as server: ... server.base_url ...``"""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", startup_timeout_s: float = 60.0):
        self.app = app
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> BackgroundServer:
        # proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only then,
        # and without it every response waits ~40 ms on Nagle + delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start; see its log above")
            time.sleep(0.01)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(30)
