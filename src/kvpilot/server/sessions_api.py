"""``/v1/sessions``: create, inspect, fork, pause and close agent sessions."""

from __future__ import annotations

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
from kvpilot.server.session_states import session_states
from kvpilot.server.state import get_state, get_tenant
from kvpilot.server.tenancy import cache_salt
from kvpilot.server.tiers import TIERS, pause_info, session_residency

router = APIRouter()


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


@router.get("/v1/sessions")
async def list_sessions(
    request: Request, tenant: str | None = Depends(get_tenant)
) -> dict[str, Any]:
    """The caller's open sessions: what each is doing now (running, waiting, paused, idle),
    its counters and its last pause decision (what `kvpilot top` shows)."""
    state = get_state(request)
    records = state.sessions.of_tenant(tenant)

    def read(engine: Engine) -> dict[str, tuple[str, int, dict[str, Any] | None]]:
        states = session_states(engine, [r.session_id for r in records])
        return {
            sid: (st, engine.sessions[sid].num_tokens, pause_info(engine, sid))
            for sid, st in states.items()
        }

    live = await state.engine.call(read)
    data = []
    for record in records:
        if record.session_id not in live:
            continue
        now, tokens, pause = live[record.session_id]
        if pause is not None:
            record.last_pause = pause
        data.append(
            {
                "id": record.session_id,
                "object": "session",
                "state": now,
                "tokens": tokens,
                "turns": record.turns,
                "prompt_tokens": record.prompt_tokens,
                "cached_tokens": record.cached_tokens,
                "hit_rate": record.hit_rate,
                "last_pause": record.last_pause,
            }
        )
    return {"object": "list", "data": data}


@router.get("/v1/sessions/{session_id}")
async def get_session(
    session_id: str, request: Request, tenant: str | None = Depends(get_tenant)
) -> dict[str, Any]:
    state = get_state(request)
    record = state.sessions.get(session_id, tenant)

    def read(engine: Engine) -> dict[str, Any]:
        session = _engine_session(engine, session_id)
        return {
            "tokens": session.num_tokens,
            "computed_tokens": session.traj.num_computed_tokens,
            "blocks": session_residency(engine, session),
            "active_request": session.active_request,
            "pause": pause_info(engine, session_id),
        }

    live = await state.engine.call(read)
    if live["pause"] is not None:
        record.last_pause = live["pause"]
    return {
        "id": session_id,
        "object": "session",
        "cache_salt": record.cache_salt,
        "turns": record.turns,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "cached_tokens_by_tier": {t: record.cached_tokens_by_tier[t] for t in TIERS},
        "hit_rate": record.hit_rate,
        # H_prefix = sum(S_match) / sum(S_prompt) over the trajectory's turns, with the
        # prefix breaks seen (by cause) and reuse per conversation sharing the session.
        "h_prefix": record.hit_rate,
        **(
            state.prompt_cache.describe_group(("session", session_id))
            if state.prompt_cache is not None
            else {}
        ),
        "last_divergence_index": record.last_divergence_index,
        "paused": live.pop("pause") is not None,
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
    request: Request,
    body: PauseSessionRequest | None = None,
    tenant: str | None = Depends(get_tenant),
) -> dict[str, Any]:
    """The agent went off to a tool: the engine's pause policy decides what becomes of the
    session's KV (retain, offload to host or disk, drop) and says why."""
    state = get_state(request)
    record = state.sessions.get(session_id, tenant)
    wait = body.expected_wait_s if body else None
    tool = body.tool if body else None

    def run(engine: Engine) -> dict[str, Any] | None:
        session = _engine_session(engine, session_id)
        if session.active_request is not None:
            raise _busy(session, "pause")
        session.pause(wait, tool)
        return pause_info(engine, session_id)

    info = await state.engine.call(run)
    assert info is not None  # a pause always leaves its record
    record.last_pause = info
    return {"id": session_id, "object": "session.pause", **info}


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
