"""The usage ledger: tokens and cost per tenant, API key, model and hour, in SQLite.

One row per (hour, tenant, API key, model) holds the sums of every request's usage in that
hour: requests, input (uncached), cached-read, cache-write (by TTL) and output tokens, and
their cost from the `PriceTable`. The database lives next to the disk tier (or in the folder
``--usage-dir`` names; in memory when there is neither), so billing survives a restart.

API keys are never stored: a key is recorded as the first 12 hex digits of its SHA-256.
Calls come from the server's event loop and from tests; a lock keeps them one at a time.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpilot.promptcache.prices import PriceTable
from kvpilot.store.faults import DISK_FAULTS, FaultEpisodes

log = logging.getLogger(__name__)

LEDGER_FILE = "usage.sqlite"
ANONYMOUS = ""  # the tenant and key of a server without API keys

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    hour INTEGER NOT NULL,
    tenant TEXT NOT NULL,
    api_key TEXT NOT NULL,
    model TEXT NOT NULL,
    requests INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    cached_read_tokens INTEGER NOT NULL,
    cache_write_tokens INTEGER NOT NULL,
    cache_write_by_ttl TEXT NOT NULL,
    output_tokens INTEGER NOT NULL,
    cost REAL NOT NULL,
    PRIMARY KEY (hour, tenant, api_key, model)
)
"""


@dataclass(frozen=True, slots=True)
class RequestUsage:
    """One request's usage, as its response reported it."""

    input_tokens: int  # uncached: computed and not written at a breakpoint
    cached_read_tokens: int
    output_tokens: int
    cache_write_tokens_by_ttl: Mapping[float, int] = field(default_factory=dict)

    @property
    def cache_write_tokens(self) -> int:
        return sum(self.cache_write_tokens_by_ttl.values())


@dataclass(frozen=True, slots=True)
class UsageRow:
    hour_start_s: int
    tenant: str
    api_key: str
    model: str
    requests: int
    input_tokens: int
    cached_read_tokens: int
    cache_write_tokens: int
    cache_write_tokens_by_ttl: dict[str, int]
    output_tokens: int
    cost: float

    def to_json(self) -> dict[str, Any]:
        return {
            "start_time": self.hour_start_s,
            "end_time": self.hour_start_s + 3600,
            "tenant": self.tenant or None,
            "api_key_id": self.api_key or None,
            "model": self.model,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "cached_read_tokens": self.cached_read_tokens,
            "cache_write_tokens": self.cache_write_tokens,
            "cache_write_tokens_by_ttl": self.cache_write_tokens_by_ttl,
            "output_tokens": self.output_tokens,
            "cost": self.cost,
        }


def ttl_label(ttl_s: float) -> str:
    s = int(ttl_s)
    if s % 3600 == 0:
        return f"{s // 3600}h"
    if s % 60 == 0:
        return f"{s // 60}m"
    return f"{s}s"


class UsageLedger:
    def __init__(self, folder: str | Path | None, prices: PriceTable | None = None) -> None:
        self.prices = prices or PriceTable()
        self.path = None if folder is None else Path(folder) / LEDGER_FILE
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(
            ":memory:" if self.path is None else str(self.path), check_same_thread=False
        )
        self._lock = threading.Lock()
        # A full or failing disk loses ledger rows (counted, logged once per episode), never
        # a request.
        self.faults = FaultEpisodes(f"writing the usage ledger {self.path or '(memory)'}", log)
        with self._lock, self._db:
            self._db.execute(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def record(
        self,
        usage: RequestUsage,
        *,
        model: str,
        tenant: str | None,
        api_key: str | None,
        now_s: float,
    ) -> float:
        """Add one request's usage to its hour's row; returns the request's cost."""
        cost = self.prices.for_model(model).cost(
            input_tokens=usage.input_tokens,
            cached_read_tokens=usage.cached_read_tokens,
            cache_write_tokens_by_ttl=usage.cache_write_tokens_by_ttl,
            output_tokens=usage.output_tokens,
        )
        hour = int(now_s // 3600 * 3600)
        key = (hour, tenant or ANONYMOUS, api_key or ANONYMOUS, model)
        try:
            self._add(key, usage, cost)
        except DISK_FAULTS as exc:
            self.faults.failed(exc)
            return cost
        self.faults.succeeded()
        return cost

    def _add(self, key: tuple[int, str, str, str], usage: RequestUsage, cost: float) -> None:
        with self._lock, self._db:
            row = self._db.execute(
                "SELECT cache_write_by_ttl FROM usage "
                "WHERE hour=? AND tenant=? AND api_key=? AND model=?",
                key,
            ).fetchone()
            by_ttl: dict[str, int] = json.loads(row[0]) if row else {}
            for ttl, n in usage.cache_write_tokens_by_ttl.items():
                if n:
                    label = ttl_label(ttl)
                    by_ttl[label] = by_ttl.get(label, 0) + n
            self._db.execute(
                "INSERT INTO usage VALUES (?, ?, ?, ?, 1, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (hour, tenant, api_key, model) DO UPDATE SET "
                "requests = requests + 1, "
                "input_tokens = input_tokens + excluded.input_tokens, "
                "cached_read_tokens = cached_read_tokens + excluded.cached_read_tokens, "
                "cache_write_tokens = cache_write_tokens + excluded.cache_write_tokens, "
                "cache_write_by_ttl = excluded.cache_write_by_ttl, "
                "output_tokens = output_tokens + excluded.output_tokens, "
                "cost = cost + excluded.cost",
                (
                    *key,
                    usage.input_tokens,
                    usage.cached_read_tokens,
                    usage.cache_write_tokens,
                    json.dumps(by_ttl, sort_keys=True),
                    usage.output_tokens,
                    cost,
                ),
            )

    def query(self, tenant: str | None, start_s: float, end_s: float) -> list[UsageRow]:
        """The tenant's rows whose hour overlaps [start_s, end_s), oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT hour, tenant, api_key, model, requests, input_tokens, "
                "cached_read_tokens, cache_write_tokens, cache_write_by_ttl, output_tokens, cost "
                "FROM usage WHERE tenant=? AND hour > ? AND hour < ? "
                "ORDER BY hour, api_key, model",
                (tenant or ANONYMOUS, start_s - 3600, end_s),
            ).fetchall()
        return [
            UsageRow(
                int(r[0]), r[1], r[2], r[3], r[4], r[5], r[6], r[7], json.loads(r[8]), r[9], r[10]
            )
            for r in rows
        ]


def totals(rows: list[UsageRow]) -> dict[str, Any]:
    by_ttl: dict[str, int] = {}
    for r in rows:
        for label, n in r.cache_write_tokens_by_ttl.items():
            by_ttl[label] = by_ttl.get(label, 0) + n
    return {
        "requests": sum(r.requests for r in rows),
        "input_tokens": sum(r.input_tokens for r in rows),
        "cached_read_tokens": sum(r.cached_read_tokens for r in rows),
        "cache_write_tokens": sum(r.cache_write_tokens for r in rows),
        "cache_write_tokens_by_ttl": by_ttl,
        "output_tokens": sum(r.output_tokens for r in rows),
        "cost": sum(r.cost for r in rows),
    }
