"""Running the server as an operator expects: liveness settings, the admin key, and a
graceful shutdown that cannot hang.

On SIGTERM or SIGINT alike, `GracefulServer` stops accepting connections (``/ready`` fails at
once), gives in-flight requests ``shutdown_timeout_s`` to finish, then cancels them (their
engine requests are aborted), and shuts the app down: the engine thread stops, the disk
writer is flushed and the stores are closed. The process then exits 0. A second SIGINT
forces the exit without waiting.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from types import FrameType

import uvicorn

from kvpilot.errors import ConfigError


@dataclass(frozen=True, slots=True)
class OpsConfig:
    """Operations settings of the server: liveness, the admin key, shutdown."""

    liveness_s: float = 30.0  # /health fails when the loop has not gone round for this long
    metrics_key: str | None = None  # admin key for /metrics (and /health's details)
    shutdown_timeout_s: float = 30.0  # in-flight requests get this long, then are aborted

    def __post_init__(self) -> None:
        if not self.liveness_s > 0:
            raise ConfigError(f"the liveness window must be positive, got {self.liveness_s}")
        if not 0 <= self.shutdown_timeout_s < 86400:
            raise ConfigError(
                f"--shutdown-timeout must be in [0, 86400) seconds, got {self.shutdown_timeout_s}"
            )
        if self.metrics_key is not None and (
            not self.metrics_key or any(c.isspace() for c in self.metrics_key)
        ):
            raise ConfigError("--metrics-key must be non-empty and contain no whitespace")


class GracefulServer(uvicorn.Server):
    """uvicorn with a bounded graceful shutdown, a drain hook, and exit status 0 on signals."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_drain = on_drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            self.on_drain()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's, without re-raising the captured signal afterwards: a shutdown asked for
        by SIGTERM or SIGINT that went well exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def drain_hook(app: object) -> Callable[[], None]:
    """Marks the app's server state as draining (``/ready`` answers 503 from then on)."""

    def drain() -> None:
        state = getattr(getattr(app, "state", None), "kvpilot", None)
        if state is not None:
            state.draining = True

    return drain
