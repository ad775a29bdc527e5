"""The front's HTTP app: the single-engine API, routed across the fleet (`FleetFront`)."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kvpilot.errors import NoReplicaAvailable
from kvpilot.fleet.load import RouteRequest
from kvpilot.fleet.serve.front import FleetFront, ReplicaDown, _reply_text, _sse_text
from kvpilot.fleet.serve.metrics import merge_replica_metrics, router_metrics
from kvpilot.fleet.serve.sessions import FrontSession
from kvpilot.server.protocol import ApiError, error_body
from kvpilot.server.tenancy import cache_salt


def unavailable(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, "server_error", code="no_replica"), status_code=503)


def create_front_app(front: FleetFront) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await front.start()
        try:
            yield
        finally:
            await front.stop()
            await front.http.aclose()

    app = FastAPI(title="kvpilot fleet", lifespan=lifespan)
    app.state.front = front

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(NoReplicaAvailable)
    async def no_replica(request: Request, exc: NoReplicaAvailable) -> JSONResponse:
        return unavailable(str(exc))

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await generate(front, request, "/v1/completions")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        return await generate(front, request, "/v1/chat/completions")

    @app.post("/v1/sessions", response_model=None)
    async def create_session(request: Request) -> Response:
        return await create(front, request)

    @app.api_route("/v1/sessions/{session_id}", methods=["GET", "DELETE"], response_model=None)
    async def session(session_id: str, request: Request) -> Response:
        return await session_op(front, request, session_id, "")

    @app.post("/v1/sessions/{session_id}/{action}", response_model=None)
    async def session_action(session_id: str, action: str, request: Request) -> Response:
        return await session_op(front, request, session_id, f"/{action}")

    @app.get("/health")
    async def health() -> JSONResponse:
        replicas: dict[str, Any] = {}
        for name, view in front.fleet.replicas.items():
            entry: dict[str, Any] = {"up": view.live}
            if view.live:
                entry["load"] = {
                    "waiting_tokens": view.load.waiting_tokens,
                    "running": view.load.running,
                    "kv_usage": view.load.kv_usage,
                }
                entry["directory_blocks"] = (
                    front.directory.num_blocks(name) if name in front.directory.replicas else 0
                )
            replicas[name] = entry
        up = sum(1 for v in front.fleet.replicas.values() if v.live)
        body = {
            "status": "ok" if up else "error",
            "model": front.config.model,
            "router": front.config.router,
            "replicas_up": up,
            "replicas": replicas,
            "sessions": len(front.sessions),
        }
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        texts: dict[str, str] = {}
        for name, view in front.fleet.replicas.items():
            if not view.live:
                continue
            try:
                response = await front.forward(name, "GET", "/metrics", {}, None)
                texts[name] = (await response.aread()).decode()
                await response.aclose()
            except ReplicaDown as exc:
                front.mark_down(name, exc)
        router = front.router
        text = merge_replica_metrics(texts) + router_metrics(
            front.config.router,
            front.routed,
            {n: v.live for n, v in front.fleet.replicas.items()},
            front.directory.events_applied,
            front.directory.resyncs,
            int(getattr(router, "migrations", 0)),
            front.retries,
        )
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"], response_model=None)
    async def anything(path: str, request: Request) -> Response:
        return await forward_anywhere(front, request, "/" + path)

    return app


async def forward_anywhere(front: FleetFront, request: Request, path: str) -> Response:
    """Requests the router has no opinion on (models, malformed bodies): any live replica."""
    body = await request.body()
    for view in front.fleet.live():
        try:
            response = await front.forward(
                view.name, request.method, path, front.headers(request), body or None
            )
        except ReplicaDown as exc:
            front.mark_down(view.name, exc)
            continue
        return await _whole(response)
    return unavailable("no replica of the fleet is up; retry once one has (re)started")


REPLICA_HEADER = "x-kvpilot-replica"  # which replica answered (for clients and benchmarks)


async def _whole(
    response: httpx.Response, replace: tuple[str, str] | None = None, replica: str | None = None
) -> Response:
    try:
        data = await response.aread()
    finally:
        await response.aclose()
    if replace is not None and replace[0] != replace[1]:
        data = data.replace(replace[0].encode(), replace[1].encode())
    return Response(
        data,
        status_code=response.status_code,
        media_type=response.headers.get("content-type"),
        headers={REPLICA_HEADER: replica} if replica else None,
    )


async def _session_gone(response: httpx.Response) -> bool:
    """A 404 for a session the front knows: its replica lost it (it restarted). The response
    is closed when it says so."""
    if response.status_code != 404:
        return False
    data = await response.aread()
    if b"session_not_found" not in data and b"was closed" not in data:
        return False
    await response.aclose()
    return True


def _json_body(raw: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


async def generate(front: FleetFront, request: Request, path: str) -> Response:
    raw = await request.body()
    body = _json_body(raw)
    if body is None:
        return await forward_anywhere(front, request, path)
    headers = front.headers(request)
    tenant = front.tenant(request)
    chat = path.endswith("/chat/completions")
    sid = body.get("session_id")
    session: FrontSession | None = None
    if isinstance(sid, str):
        session = front.sessions.get(sid, tenant)
        if session is None:
            return await forward_anywhere(front, request, path)  # the replica's 404
    conversation = body.get("messages")
    whole_text: str | None = None
    if session is not None:
        conversation = session.conversation(body) if chat else None
        whole_text = None if chat else session.completion_text(body)
    route_body = body if whole_text is None else {**body, "prompt": whole_text}
    tokens = front.prompt_tokens(path, route_body, conversation)
    salt_in = session.cache_salt if session is not None else body.get("cache_salt")
    key = body.get("prompt_cache_key")
    route_request = RouteRequest(
        f"front-{secrets.token_hex(6)}",
        tokens,
        cache_salt(tenant, salt_in if isinstance(salt_in, str) else None),
        session=session.session_id if session is not None else None,
        cache_key=key if isinstance(key, str) else None,
    )
    tried: set[str] = set()
    rebuilt = 0
    while True:
        decision = front.route(route_request)
        replica = decision.replica
        if replica in tried:
            return unavailable(f"every replica failed this request (tried {sorted(tried)})")
        tried.add(replica)
        out = dict(body)
        routed = False
        try:
            if session is not None:
                stale = session.lost or not front.fleet[session.replica].live
                if stale or session.replica != replica:
                    await front.move_session(session, replica, headers)
                out["session_id"] = session.local_id
                out["session_create"] = False  # a replica that lost it says so (404)
                if session.moves and session.resend:
                    if chat:
                        out["messages"] = conversation
                    elif whole_text is not None:
                        out["prompt"] = whole_text
                    out["session_history"] = "full"
            front.router.on_routed(route_request, decision, front.now())
            routed = True
            front.routed[replica] += 1
            response = await front.forward(replica, "POST", path, headers, json.dumps(out).encode())
        except ReplicaDown as exc:
            if routed:
                front.router.on_finished(route_request, replica)
            front.mark_down(replica, exc)
            front.retries += 1
            continue
        if session is not None and rebuilt < 2 and await _session_gone(response):
            # The replica restarted before a poll told us: rebuild the session and resend.
            front.router.on_finished(route_request, replica)
            session.lost = True
            rebuilt += 1
            tried.discard(replica)
            front.retries += 1
            continue
        break

    def done(ok: bool, reply: str | None) -> None:
        front.router.on_finished(route_request, replica)
        if session is None or not ok or reply is None:
            return
        session.resend = False
        if chat:
            session.record_chat(list(conversation or []), reply)
        else:
            session.record_completion(whole_text, reply)

    swap = (session.local_id, session.session_id) if session is not None else None
    if not body.get("stream"):
        result = await _whole(response, swap, replica)
        ok = result.status_code == 200
        reply = None
        if ok and session is not None:
            reply = _reply_text(_json_body(result.body), chat)  # type: ignore[arg-type]
        done(ok, reply)
        return result

    async def relay() -> AsyncIterator[bytes]:
        pieces: list[str] = []
        ok = response.status_code == 200
        try:
            async for chunk in response.aiter_raw():
                if session is not None:
                    pieces.append(_sse_text(chunk.decode(errors="replace"), chat))
                if swap is not None and swap[0] != swap[1]:
                    chunk = chunk.replace(swap[0].encode(), swap[1].encode())
                yield chunk
        except httpx.TransportError:
            ok = False
            front.mark_down(replica, "its stream broke off")
        finally:
            await response.aclose()
            done(ok, "".join(pieces))

    return StreamingResponse(
        relay(),
        status_code=response.status_code,
        media_type=response.headers.get("content-type"),
        headers={REPLICA_HEADER: replica},
    )


async def create(front: FleetFront, request: Request) -> Response:
    raw = await request.body()
    body = _json_body(raw) if raw else {}
    if body is None:
        return await forward_anywhere(front, request, "/v1/sessions")
    tenant = front.tenant(request)
    salt_in = body.get("cache_salt")
    salt = cache_salt(tenant, salt_in if isinstance(salt_in, str) else None)
    probe = RouteRequest(f"front-{secrets.token_hex(6)}", (), salt)
    while True:
        decision = front.route(probe)
        try:
            response = await front.forward(
                decision.replica, "POST", "/v1/sessions", front.headers(request), raw or None
            )
        except ReplicaDown as exc:
            front.mark_down(decision.replica, exc)
            continue
        break
    result = await _whole(response)
    if result.status_code == 200:
        data = _json_body(result.body) or {}  # type: ignore[arg-type]
        sid = str(data["id"])
        front.sessions.add(
            FrontSession(
                sid, tenant, salt_in if isinstance(salt_in, str) else None, decision.replica, sid
            )
        )
        home = RouteRequest(probe.request_id, (), salt, session=sid)
        front.router.on_routed(home, decision, front.now())
        front.router.on_finished(home, decision.replica)
    return result


async def session_op(front: FleetFront, request: Request, sid: str, action: str) -> Response:
    tenant = front.tenant(request)
    session = front.sessions.get(sid, tenant)
    path = f"/v1/sessions/{sid}{action}"
    if session is None:
        return await forward_anywhere(front, request, path)  # the replica's 404
    headers = front.headers(request)
    raw = await request.body()
    rebuilt = 0
    while True:
        if session.lost or not front.fleet[session.replica].live:
            target = front.route(
                RouteRequest(f"front-{secrets.token_hex(6)}", (), None, session=session.session_id)
            )
            try:
                await front.move_session(session, target.replica, headers)
            except ReplicaDown as exc:
                front.mark_down(target.replica, exc)
                continue
        try:
            response = await front.forward(
                session.replica,
                request.method,
                f"/v1/sessions/{session.local_id}{action}",
                headers,
                raw or None,
            )
        except ReplicaDown as exc:
            front.mark_down(session.replica, exc)
            continue
        if rebuilt < 2 and await _session_gone(response):
            session.lost = True
            rebuilt += 1
            continue
        break
    result = await _whole(response, (session.local_id, session.session_id))
    if result.status_code == 200 and request.method == "DELETE":
        front.sessions.remove(sid)
        router = front.router
        if hasattr(router, "forget"):
            router.forget(RouteRequest("", (), None, session=sid))
    elif result.status_code == 200 and action == "/fork":
        data = _json_body(result.body) or {}  # type: ignore[arg-type]
        for child in data.get("forks", []):
            front.sessions.add(
                FrontSession(
                    str(child),
                    tenant,
                    session.cache_salt,
                    session.replica,
                    str(child),
                    messages=list(session.messages),
                    text=session.text,
                    resendable=session.resendable,
                )
            )
    return result
