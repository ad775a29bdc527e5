"""What the HTTP routes do to sessions, keeping the registry and the engine in step.

- `resolve` finds a client's session, or creates it on first use (quota checked), so a
  client may simply name its session in ``extra_body.session_id``.
- `ensure_engine_session` (engine thread) opens the engine's side on first use: after a
  restart the engine restores the session's tokens from its `SessionStore`, and its KV comes
  back from the disk tier on the next turn (what is still there and verifies).
- A finished turn's tokens are saved (`responses.finish`), so a crash loses nothing a client
  has seen; a paused session's tokens are saved by the pause itself.
- `expire` closes sessions idle past the TTL (their KV goes to the prefix cache, their
  tokens leave the disk); `run_expiry` does so periodically.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from kvpilot.engine import Engine, Session
from kvpilot.server.session_registry import (
    ServerSession,
    SessionRegistry,
    bucket_of,
    check_session_id,
)
from kvpilot.server.tenancy import cache_salt

if TYPE_CHECKING:
    from kvpilot.server.state import ServerState

log = logging.getLogger("kvpilot.server")


def resolve(
    state: ServerState,
    tenant: str | None,
    client: str | None,
    session_id: str,
    *,
    create: bool,
    salt: str | None = None,
) -> ServerSession:
    """The tenant's session ``session_id``; created (quota checked) if absent and ``create``."""
    registry = state.sessions
    found = registry.find(session_id, tenant)
    if found is not None or not create:
        return found if found is not None else registry.get(session_id, tenant)
    check_session_id(session_id)
    bucket = bucket_of(tenant, client)
    registry.check_quota(bucket)
    return registry.add(ServerSession(session_id, tenant, salt, bucket=bucket))


def ensure_engine_session(engine: Engine, record_id: str, salt: str | None) -> Session:
    """Engine thread: the engine's session, opened (or restored from disk) on first use."""
    session = engine.sessions.get(record_id)
    if session is None:
        session = engine.open_session(salt=salt, session_id=record_id)
    return session


def engine_salt(record: ServerSession) -> str | None:
    return cache_salt(record.tenant, record.cache_salt)


async def close(state: ServerState, record: ServerSession) -> None:
    """Close the session on the engine and forget it."""
    eid = record.engine_id

    def close_on_engine(engine: Engine) -> None:
        session = engine.sessions.get(eid)
        if session is not None:
            session.close()
        elif engine.offload.session_store is not None:
            engine.offload.session_store.delete(eid)

    await state.engine.call(close_on_engine)
    state.sessions.remove(record.session_id, record.tenant)


async def expire(state: ServerState) -> int:
    """Close every session idle for longer than the TTL; how many."""
    expired = state.sessions.expired()
    for record in expired:
        log.info(
            "session %s expired after %.0f s idle (--session-ttl)",
            record.session_id,
            state.sessions.ttl_s,
        )
        await close(state, record)
    return len(expired)


async def run_expiry(state: ServerState) -> None:
    """Expire idle sessions every few seconds (a quarter of the TTL, at most 30 s)."""
    period = max(0.05, min(30.0, state.sessions.ttl_s / 4))
    while True:
        await asyncio.sleep(period)
        try:
            await expire(state)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("expiring idle sessions failed; trying again later")


def load_registry(registry: SessionRegistry, records: list[ServerSession]) -> None:
    registry.restore(records)
    if records:
        log.info("restored %d sessions from the session registry", len(records))
