"""The disk tier's SQLite index: key -> slot, length, checksum and times, plus the geometry and
the fingerprint of the model whose KV the blocks are."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvpilot.errors import ConfigError
from kvpilot.memory.hashing import ModelFingerprint

log = logging.getLogger(__name__)

INDEX_FILENAME = "index.sqlite3"
# 1: blake2b-16 checksums. 2: XXH3-128 (a version-1 store's blocks are dropped on open).
SCHEMA_VERSION = 2
_OLD_CHECKSUMS = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS geometry (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS model (
    digest BLOB NOT NULL,
    label TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS blocks (
    key BLOB PRIMARY KEY,
    slot INTEGER NOT NULL UNIQUE CHECK (slot >= 0),
    length INTEGER NOT NULL CHECK (length >= 0),
    checksum BLOB NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL
);
"""


@dataclass(slots=True)
class IndexEntry:
    """Where a block lives and how to verify it. Mutable: ``last_access`` moves on every use."""

    slot: int
    length: int
    checksum: bytes
    created: float
    last_access: float


class BlockIndex:
    """One SQLite connection, used by one thread at a time (the store serialises access).

    Changes are applied in one transaction per ``commit``, deletions first, so a slot handed
    from an evicted block to a new one never has two rows at once.

    Opened with a ``model`` fingerprint, the index holds only that model's KV: a store written
    by another model (or before fingerprints were recorded) has its blocks ignored (their
    rows dropped, their slots reused, its geometry replaced), with a warning saying why.
    Without one, whatever model is recorded is kept (tools that only read the store).
    """

    def __init__(
        self,
        path: Path,
        *,
        num_slots: int,
        block_bytes: int,
        create: bool,
        model: ModelFingerprint | None = None,
    ) -> None:
        if not create and not path.exists():
            raise ConfigError(
                f"no disk block store at {path.parent} ({path.name} is missing); "
                "pass create=True to start an empty one"
            )
        self.path = path
        self.dropped_other_model = 0  # blocks of another model dropped when opening
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            self._init_schema(num_slots, block_bytes, model)
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise ConfigError(
                f"{path} is not a readable kvpilot disk index ({exc}); "
                "remove the directory or point the store at another one"
            ) from exc
        except BaseException:
            self._conn.close()
            raise

    def _init_schema(
        self, num_slots: int, block_bytes: int, model: ModelFingerprint | None
    ) -> None:
        conn = self._conn
        conn.execute("PRAGMA journal_mode=WAL")
        # In WAL mode NORMAL survives a process crash; a power loss may drop the last commits,
        # which loses rows, never points a row at unwritten data.
        conn.execute("PRAGMA synchronous=NORMAL")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, _OLD_CHECKSUMS, SCHEMA_VERSION):
            raise ConfigError(
                f"{self.path} has index schema version {version}, this kvpilot reads "
                f"version {SCHEMA_VERSION}; remove the directory to start an empty store"
            )
        conn.executescript(_SCHEMA)
        stored = dict(conn.execute("SELECT name, value FROM geometry").fetchall())
        wanted = {"num_slots": num_slots, "block_bytes": block_bytes}
        if stored and model is not None and self._other_model(model):
            stored = {}  # the other model's blocks go: start over in this geometry
        if stored and version == _OLD_CHECKSUMS:
            log.warning(
                "disk store at %s was written by an older kvpilot (other block checksums): "
                "its blocks are dropped, their slots reused",
                self.path.parent,
            )
            stored = {}
        if not stored:
            conn.execute("BEGIN")
            conn.execute("DELETE FROM blocks")
            conn.execute("DELETE FROM geometry")
            conn.executemany("INSERT INTO geometry VALUES (?, ?)", wanted.items())
            if model is not None:
                conn.execute("DELETE FROM model")
                conn.execute("INSERT INTO model VALUES (?, ?)", (model.digest, model.label))
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            conn.execute("COMMIT")
        elif stored != wanted:
            raise ConfigError(
                f"disk block store at {self.path.parent} was created with "
                f"num_slots={stored.get('num_slots')}, block_bytes={stored.get('block_bytes')}, "
                f"but was opened with num_slots={num_slots}, block_bytes={block_bytes}; "
                "open it with its original geometry, or use a new directory"
            )

    def _other_model(self, model: ModelFingerprint) -> bool:
        """True (with a warning saying why they will be dropped) when the store's blocks are
        not ``model``'s."""
        conn = self._conn
        row = conn.execute("SELECT digest, label FROM model").fetchone()
        if row is not None and bytes(row[0]) == model.digest:
            return False
        blocks = conn.execute("SELECT COUNT(*) FROM blocks").fetchone()[0]
        if row is None and not blocks:
            return True  # an empty store: it is this model's from now on
        writer = f"model {row[1]}" if row is not None else "a model it did not record"
        log.warning(
            "disk store at %s holds the KV of %s; this engine runs %s: its %d blocks are "
            "ignored (dropped, their slots reused)",
            self.path.parent,
            writer,
            model.label,
            blocks,
        )
        self.dropped_other_model = blocks
        return True

    def load(self) -> list[tuple[bytes, IndexEntry]]:
        """Every row, least recently used first."""
        rows = self._conn.execute(
            "SELECT key, slot, length, checksum, created, last_access FROM blocks "
            "ORDER BY last_access, created, slot"
        ).fetchall()
        return [(bytes(key), IndexEntry(*rest)) for key, *rest in rows]

    def commit(
        self,
        *,
        deletes: Iterable[bytes] = (),
        inserts: Iterable[tuple[bytes, IndexEntry]] = (),
        touches: Iterable[tuple[bytes, float]] = (),
    ) -> None:
        conn = self._conn
        conn.execute("BEGIN")
        try:
            conn.executemany("DELETE FROM blocks WHERE key = ?", ((k,) for k in deletes))
            conn.executemany(
                "INSERT INTO blocks VALUES (?, ?, ?, ?, ?, ?)",
                ((k, e.slot, e.length, e.checksum, e.created, e.last_access) for k, e in inserts),
            )
            conn.executemany(
                "UPDATE blocks SET last_access = ? WHERE key = ?", ((t, k) for k, t in touches)
            )
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # a failed COMMIT (a full disk) leaves it open
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._conn.close()
