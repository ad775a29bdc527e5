"""``/v1/sessions``: create, inspect, fork, pause and close agent sessions."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

from fastapi import APIRouter, Depends, Request

from kvpilot.engine import Engine, Session
from kvpilot.server.protocol import (
    ApiError,
    CreateSessionRequest,
    ForkSessionRequest,
    PauseSessionRequest,
)
from kvpilot.server.session_registry import ServerSession
from kvpilot.server.state import ServerState, get_state, get_tenant
from kvpilot.server.tenancy import cache_salt

router = APIRouter()

PAUSE_UNSUPPORTED = (
    "pausing needs the engine's pause policy (Session.pause), which this build of the "
    "engine does not have yet"
)


def _engine_session(engine: Engine, session_id: str) -> Session:
    session = engine.sessions.get(session_id)
    if session is None:
        raise ApiError(404, f"session {session_id!r} was closed", type="not_found_error")
    return session


def _busy(session: Session, action: str) -> ApiError:
    return ApiError(
        409,
        f"cannot {action} session {session.session_id} while turn {session.active_request} "
        "runs: wait for it to finish",
        type="conflict_error",
        code="session_busy",
    )


@router.post("/v1/sessions")
async def create_session(
    request: Request,
    body: CreateSessionRequest | None = None,
    tenant: str | None = Depends(get_tenant),
) -> dict[str, Any]:
    state = get_state(request)
    state.limits.check_sessions(state.sessions.count(tenant))
    salt_in = body.cache_salt if body else None
    session_id = state.sessions.new_id()
    salt = cache_salt(tenant, salt_in)
    await state.engine.call(lambda e: e.open_session(salt=salt, session_id=session_id))
    state.sessions.add(ServerSession(session_id, tenant, salt_in))
    return {"id": session_id, "object": "session", "cache_salt": salt_in}


@router.get("/v1/sessions/{session_id}")
async def get_session(
    session_id: str, request: Request, tenant: str | None = Depends(get_tenant)
) -> dict[str, Any]:
    state = get_state(request)
    record = state.sessions.get(session_id, tenant)

    def read(engine: Engine) -> dict[str, Any]:
        session = _engine_session(engine, session_id)
        traj = session.traj
        return {
            "tokens": session.num_tokens,
            "computed_tokens": traj.num_computed_tokens,
            "blocks_held": len(traj.block_table),
            "private_blocks": getattr(traj, "num_private_blocks", None),
            "active_request": session.active_request,
            "pause_supported": hasattr(session, "pause"),
        }

    live = await state.engine.call(read)
    return {
        "id": session_id,
        "object": "session",
        "cache_salt": record.cache_salt,
        "turns": record.turns,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "hit_rate": record.hit_rate,
        "last_divergence_index": record.last_divergence_index,
        "last_pause": record.last_pause,
        **live,
    }


@router.post("/v1/sessions/{session_id}/fork")
async def fork_session(
    session_id: str,
    request: Request,
    body: ForkSessionRequest | None = None,
    tenant: str | None = Depends(get_tenant),
) -> dict[str, Any]:
    state = get_state(request)
    record = state.sessions.get(session_id, tenant)
    n = body.n if body else 1
    state.limits.check_sessions(state.sessions.count(tenant), n)

    def fork(engine: Engine) -> list[str]:
        session = _engine_session(engine, session_id)
        if session.active_request is not None:
            raise _busy(session, "fork")
        return [child.session_id for child in session.fork(n)]

    children = await state.engine.call(fork)
    for child in children:
        state.sessions.add(record.forked(child))
    return {"id": session_id, "object": "session.forks", "forks": children}


@router.post("/v1/sessions/{session_id}/pause")
async def pause(
    session_id: str,
    body: PauseSessionRequest,
    request: Request,
    tenant: str | None = Depends(get_tenant),
) -> dict[str, Any]:
    state = get_state(request)
    record = state.sessions.get(session_id, tenant)
    decision = await pause_session(state, record, body.expected_wait_s, body.tool, strict=True)
    return {"id": session_id, "object": "session.pause", **(decision or {})}


@router.delete("/v1/sessions/{session_id}")
async def delete_session(
    session_id: str, request: Request, tenant: str | None = Depends(get_tenant)
) -> dict[str, Any]:
    state = get_state(request)
    state.sessions.get(session_id, tenant)

    def close(engine: Engine) -> None:
        session = engine.sessions.get(session_id)
        if session is not None:
            session.close()

    await state.engine.call(close)
    state.sessions.remove(session_id)
    return {"id": session_id, "object": "session.deleted", "deleted": True}


async def pause_session(
    state: ServerState,
    record: ServerSession,
    expected_wait_s: float,
    tool: str | None,
    *,
    strict: bool,
) -> dict[str, Any]:
    """Ask the engine's pause policy what to do with the session's KV while a tool runs.

    Without a pause policy in the engine: 501 when asked directly (``strict``), and a
    "not applied" note when the hint came with a turn.
    """

    def run(engine: Engine) -> Any:
        session = _engine_session(engine, record.session_id)
        method = getattr(session, "pause", None)
        if method is None:
            return None
        if session.active_request is not None:
            raise _busy(session, "pause")
        return method(expected_wait_s, tool=tool)

    decision = await state.engine.call(run)
    if decision is None:
        if strict:
            raise ApiError(501, PAUSE_UNSUPPORTED, type="not_implemented_error")
        return {"applied": False, "reason": PAUSE_UNSUPPORTED}
    info = {"applied": True, "expected_wait_s": expected_wait_s, "tool": tool}
    info |= (
        _jsonable(decision) if dataclasses.is_dataclass(decision) else {"decision": str(decision)}
    )
    record.last_pause = info
    action = info.get("action")
    if isinstance(action, str):
        state.metrics.record_pause(action)
    return info


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value
