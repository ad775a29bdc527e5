"""Paused sessions on disk, so a paused agent can be resumed after the process is restarted.

Tokens are the truth (KV blocks are derived from them), so a session is saved as its token list,
its tenant salt and a JSON ``meta`` dict; its KV blocks, if any survived, are found again in the
disk block store by the chained hashes of those tokens. Each session records the fingerprint of
the model that saved it: token ids mean something only to their model, so a store opened with
another model's fingerprint does not resume it (a log line says why).
"""

from __future__ import annotations

import builtins
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from kvpilot.errors import ConfigError, InvalidRequest, KvpilotError
from kvpilot.memory.hashing import ModelFingerprint
from kvpilot.store.faults import DISK_FAULTS, FaultEpisodes

log = logging.getLogger(__name__)

SESSIONS_FILENAME = "sessions.sqlite3"
SCHEMA_VERSION = 2  # 2: the saving model's fingerprint (version 1 stores are migrated)
_TOKEN_DTYPE = np.dtype("<i4")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    tokens BLOB NOT NULL,
    salt TEXT,
    meta TEXT NOT NULL,
    saved_at REAL NOT NULL,
    model BLOB,
    model_label TEXT
);
"""
_MIGRATE_FROM_1 = """
ALTER TABLE sessions ADD COLUMN model BLOB;
ALTER TABLE sessions ADD COLUMN model_label TEXT;
"""


@dataclass(frozen=True, slots=True)
class StoredSession:
    session_id: str
    tokens: list[int]
    salt: str | None
    meta: dict[str, Any]
    saved_at: float


class SessionStore:
    """SQLite-backed map session_id -> StoredSession. Every ``save``/``delete`` is durable
    (committed with synchronous=FULL) when it returns. Safe to share between threads.

    With a ``model`` fingerprint, saves record it and ``load`` resumes only sessions it saved.
    A disk fault on ``save`` or ``delete`` (a full disk, an I/O error) is not raised: the call
    returns False, and ``faults`` counts it (logged once per episode).
    """

    def __init__(
        self,
        directory: Path | str,
        *,
        create: bool = True,
        clock: Callable[[], float] = time.time,
        model: ModelFingerprint | None = None,
    ) -> None:
        self.path = Path(directory) / SESSIONS_FILENAME
        self.model = model
        if not self.path.exists():
            if not create:
                raise ConfigError(
                    f"no session store at {self.path}; pass create=True to start an empty one"
                )
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self.faults = FaultEpisodes(f"saving sessions to {self.path}", log)
        self._lock = threading.Lock()
        self._closed = False
        self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            if version == 1:
                self._conn.executescript(_MIGRATE_FROM_1)
                version = SCHEMA_VERSION
            if version not in (0, SCHEMA_VERSION):
                raise ConfigError(
                    f"{self.path} has session schema version {version}, this kvpilot reads "
                    f"version {SCHEMA_VERSION}; move the file away to start an empty store"
                )
            self._conn.executescript(_SCHEMA)
            self._conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise ConfigError(
                f"{self.path} is not a readable kvpilot session store ({exc})"
            ) from exc
        except BaseException:
            self._conn.close()
            raise

    def save(
        self, session_id: str, tokens: Sequence[int], salt: str | None, meta: dict[str, Any]
    ) -> bool:
        """Stores (or replaces) a session; durable on return. False if the disk failed."""
        blob = _encode_tokens(session_id, tokens)
        if not isinstance(meta, dict):
            raise InvalidRequest(f"meta of session {session_id!r} must be a dict, got {meta!r:.60}")
        try:
            meta_json = json.dumps(meta, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(
                f"meta of session {session_id!r} must be a JSON object of plain values ({exc})"
            ) from exc
        model = self.model
        fingerprint = (model.digest, model.label) if model is not None else (None, None)
        row = (session_id, blob, salt, meta_json, self._clock(), *fingerprint)
        with self._lock:
            self._check_open()
            try:
                self._conn.execute(
                    "INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?)", row
                )
            except DISK_FAULTS as exc:
                self.faults.failed(exc)
                return False
        self.faults.succeeded()
        return True

    def load(self, session_id: str) -> StoredSession | None:
        with self._lock:
            self._check_open()
            row = self._conn.execute(
                "SELECT tokens, salt, meta, saved_at, model, model_label FROM sessions "
                "WHERE session_id = ?",
                (session_id,),
            ).fetchone()
        if row is None:
            return None
        blob, salt, meta_json, saved_at, model, label = row
        if self.model is not None and (model is None or bytes(model) != self.model.digest):
            log.warning(
                "session %r in %s was saved by %s; this engine runs %s: not resumed",
                session_id,
                self.path,
                f"model {label}" if model is not None else "a model it did not record",
                self.model.label,
            )
            return None
        tokens = np.frombuffer(blob, dtype=_TOKEN_DTYPE).tolist()
        return StoredSession(session_id, tokens, salt, json.loads(meta_json), saved_at)

    def delete(self, session_id: str) -> bool:
        """Removes a session; durable on return. False if there was none (or the disk failed:
        a session left behind is dropped at the next save of its id, or resumed if asked)."""
        with self._lock:
            self._check_open()
            try:
                cur = self._conn.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,))
            except DISK_FAULTS as exc:
                self.faults.failed(exc)
                return False
        return cur.rowcount > 0

    def __contains__(self, session_id: object) -> bool:
        if not isinstance(session_id, str):
            return False
        with self._lock:
            self._check_open()
            row = self._conn.execute(
                "SELECT 1 FROM sessions WHERE session_id = ?", (session_id,)
            ).fetchone()
        return row is not None

    def __len__(self) -> int:
        with self._lock:
            self._check_open()
            return self._conn.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]

    def close(self) -> None:
        """Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()

    def __enter__(self) -> SessionStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise KvpilotError(f"session store at {self.path} is closed")

    def list(self) -> builtins.list[str]:
        """Saved session ids, oldest save first."""
        with self._lock:
            self._check_open()
            rows = self._conn.execute(
                "SELECT session_id FROM sessions ORDER BY saved_at, session_id"
            ).fetchall()
        return [r[0] for r in rows]


def _encode_tokens(session_id: str, tokens: Sequence[int]) -> bytes:
    arr = np.asarray(tokens)
    if arr.size == 0:
        return b""
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidRequest(f"tokens of session {session_id!r} must be a flat sequence of ints")
    if arr.min() < 0 or arr.max() > np.iinfo(_TOKEN_DTYPE).max:
        raise InvalidRequest(
            f"tokens of session {session_id!r} must be token ids in [0, 2**31), "
            f"got values in [{arr.min()}, {arr.max()}]"
        )
    return arr.astype(_TOKEN_DTYPE, copy=False).tobytes()
