"""The disk tier: a verified, restart-safe block store and the store of paused sessions."""

from __future__ import annotations

from kvpilot.store.disk import BlockData, DiskBlockStore
from kvpilot.store.session_store import SessionStore, StoredSession
from kvpilot.store.slots import KEY_BYTES
from kvpilot.store.stats import DiskStoreStats

__all__ = [
    "KEY_BYTES",
    "BlockData",
    "DiskBlockStore",
    "DiskStoreStats",
    "SessionStore",
    "StoredSession",
]
