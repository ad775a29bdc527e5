"""The session registry on disk (``server-sessions.sqlite3`` next to the disk tier), so that
after a crash and restart every session id a client holds still names its session.

One row per session: its tenant and id, and a JSON record (cache salt, quota bucket, the
conversation as of the last turn, the opening tokens, counters, last use, last pause). The
tokens themselves and the KV live in the engine's stores (`SessionStore`, the disk tier).
Writes are committed on return (WAL, which survives a process crash); a failing disk makes
them "not stored", counted and logged once per episode, never an error for the request.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from kvpilot.server.session_registry import ServerSession
from kvpilot.store.faults import DISK_FAULTS, FaultEpisodes

log = logging.getLogger(__name__)

REGISTRY_FILENAME = "server-sessions.sqlite3"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (tenant, id)
);
"""


class RegistryStore:
    def __init__(self, directory: Path | str) -> None:
        self.path = Path(directory) / REGISTRY_FILENAME
        self.faults = FaultEpisodes(f"saving the session registry to {self.path}", log)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(_SCHEMA)

    def load(self) -> list[ServerSession]:
        with self._lock:
            rows = self._conn.execute("SELECT tenant, id, record FROM sessions").fetchall()
        out = []
        for tenant, sid, record in rows:
            try:
                out.append(_decode(tenant or None, sid, json.loads(record)))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("session %r in %s is unreadable (%s): skipped", sid, self.path, exc)
        return out

    def save(self, session: ServerSession) -> None:
        row = (session.tenant or "", session.session_id, json.dumps(_encode(session)))
        self._write("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?)", row)

    def delete(self, session: ServerSession) -> None:
        row = (session.tenant or "", session.session_id)
        self._write("DELETE FROM sessions WHERE tenant = ? AND id = ?", row)

    def _write(self, sql: str, row: tuple[Any, ...]) -> None:
        with self._lock:
            try:
                self._conn.execute(sql, row)
            except DISK_FAULTS as exc:
                self.faults.failed(exc)
                return
        self.faults.succeeded()

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _encode(s: ServerSession) -> dict[str, Any]:
    return {
        "cache_salt": s.cache_salt,
        "bucket": list(s.bucket),
        "messages": s.messages,
        "opening_tokens": s.opening_tokens,
        "turns": s.turns,
        "prompt_tokens": s.prompt_tokens,
        "cached_tokens": s.cached_tokens,
        "cached_tokens_by_tier": dict(s.cached_tokens_by_tier),
        "last_pause": s.last_pause,
        "last_used": s.last_used,
    }


def _decode(tenant: str | None, sid: str, r: dict[str, Any]) -> ServerSession:
    bucket = r["bucket"]
    return ServerSession(
        sid,
        tenant,
        r["cache_salt"],
        bucket=(str(bucket[0]), str(bucket[1])),
        messages=list(r["messages"]),
        opening_tokens=[int(t) for t in r["opening_tokens"]],
        turns=int(r["turns"]),
        prompt_tokens=int(r["prompt_tokens"]),
        cached_tokens=int(r["cached_tokens"]),
        cached_tokens_by_tier=Counter(r["cached_tokens_by_tier"]),
        last_pause=r["last_pause"],
        last_used=float(r["last_used"]),
    )
