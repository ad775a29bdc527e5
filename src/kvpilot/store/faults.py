"""Disk faults degrade, never stop: a failed write means "not stored", counted and logged once
per episode (the first failure of a run, then the recovery), never raised to the caller.

Tokens are the truth: a block or session that was not stored is recomputed (or, for a
session, resumed from what the server still holds in memory), so a full or failing disk
costs speed, never a request.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import threading

# What a failing disk raises: ENOSPC / EIO / EDQUOT / EROFS as OSError, SQLite's "database or
# disk is full" / "disk I/O error" / "readonly database" as sqlite3.Error.
DISK_FAULTS: tuple[type[BaseException], ...] = (OSError, sqlite3.Error)


class FaultEpisodes:
    """Failed writes of one kind (``what``): a counter, and one log line per episode."""

    def __init__(self, what: str, logger: logging.Logger) -> None:
        self.what = what
        self.log = logger
        self.failures = 0  # every failed write, ever
        self._in_episode = 0  # failures since the last success
        self._lock = threading.Lock()

    def failed(self, exc: BaseException, count: int = 1) -> None:
        with self._lock:
            self.failures += count
            first = self._in_episode == 0
            self._in_episode += count
        if first:
            self.log.warning(
                "%s failed (%s): not stored, recomputed when needed; further failures are "
                "counted, not logged, until a write succeeds",
                self.what,
                describe(exc),
            )

    def succeeded(self) -> None:
        with self._lock:
            missed, self._in_episode = self._in_episode, 0
        if missed:
            self.log.warning("%s works again, after %d failed writes", self.what, missed)


def describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"
