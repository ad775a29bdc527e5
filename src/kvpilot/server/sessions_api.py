"""``/v1/sessions``: create, inspect, fork, pause and close agent sessions.

Ids are scoped per tenant (`session_registry`); a session named in a generation request's
``extra_body.session_id`` is created on first use, so ``POST /v1/sessions`` is optional.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from kvpilot.engine import Engine, Session
from kvpilot.errors import SessionBusy, SessionNotFound
from kvpilot.server.protocol import CreateSessionRequest, ForkSessionRequest, PauseSessionRequest
from kvpilot.server.session_ops import close, engine_salt, ensure_engine_session, resolve
from kvpilot.server.session_registry import ServerSession, client_session_id
from kvpilot.server.session_states import session_states
from kvpilot.server.state import client_address, get_state, get_tenant
from kvpilot.server.tiers import TIERS, pause_info, session_residency

router = APIRouter()


def _engine_session(engine: Engine, record: ServerSession) -> Session:
    return ensure_engine_session(engine, record.engine_id, engine_salt(record))


def _check_idle(session: Session, record: ServerSession, action: str) -> None:
    if session.active_request is not None:
        raise SessionBusy(
            f"cannot {action} session {record.session_id} while turn {session.active_request} "
            "runs: wait for it to finish"
        )


@router.post("/v1/sessions")
async def create_session(
    request: Request,
    body: CreateSessionRequest | None = None,
    tenant: str | None = Depends(get_tenant),
) -> dict[str, Any]:
    state = get_state(request)
    salt_in = body.cache_salt if body else None
    requested = body.session_id if body else None
    if requested is not None and state.sessions.find(requested, tenant) is not None:
        raise SessionBusy(f"session {requested!r} exists already: use it, or pick another id")
    session_id = requested or state.sessions.new_id()
    record = resolve(state, tenant, client_address(request), session_id, create=True, salt=salt_in)
    try:
        await state.engine.call(lambda e: _engine_session(e, record))
    except BaseException:
        state.sessions.remove(record.session_id, tenant)
        raise
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
        ids = [r.engine_id for r in records if r.engine_id in engine.sessions]
        states = session_states(engine, ids)
        return {
            sid: (st, engine.sessions[sid].num_tokens, pause_info(engine, sid))
            for sid, st in states.items()
        }

    live = await state.engine.call(read)
    data = []
    for record in records:
        now, tokens, pause = live.get(record.engine_id, ("idle", None, None))
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
        session = _engine_session(engine, record)
        return {
            "tokens": session.num_tokens,
            "computed_tokens": session.traj.num_computed_tokens,
            "blocks": session_residency(engine, session),
            "active_request": session.active_request,
            "pause": pause_info(engine, record.engine_id),
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
            state.prompt_cache.describe_group(("session", tenant or "", session_id))
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
    state.sessions.check_quota(record.bucket, n)

    def fork(engine: Engine) -> list[str]:
        session = _engine_session(engine, record)
        _check_idle(session, record, "fork")
        return [child.session_id for child in session.fork(n)]

    children = [client_session_id(tenant, c) for c in await state.engine.call(fork)]
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
        session = _engine_session(engine, record)
        _check_idle(session, record, "pause")
        session.pause(wait, tool)
        return pause_info(engine, record.engine_id)

    info = await state.engine.call(run)
    if info is None:
        raise SessionNotFound(f"session {session_id!r} was closed")
    record.last_pause = info
    state.sessions.changed(record)
    return {"id": session_id, "object": "session.pause", **info}


@router.delete("/v1/sessions/{session_id}")
async def delete_session(
    session_id: str, request: Request, tenant: str | None = Depends(get_tenant)
) -> dict[str, Any]:
    state = get_state(request)
    await close(state, state.sessions.get(session_id, tenant))
    return {"id": session_id, "object": "session.deleted", "deleted": True}
