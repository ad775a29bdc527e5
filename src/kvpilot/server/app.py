"""The FastAPI app: routes, error handling, and the engine thread's lifetime.

Every error leaves as the OpenAI error body ``{"error": {"message", "type", "param",
"code"}}``; bad input is a 4xx, never a 500, and never stops the engine.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpilot.engine import Engine
from kvpilot.errors import (
    InvalidRequest,
    KvpilotError,
    PromptTooLong,
    SessionBusy,
    SessionNotFound,
    SessionQuotaExceeded,
)
from kvpilot.server import completions_api, health, messages_api, sessions_api, usage_api
from kvpilot.server.anthropic_protocol import anthropic_error_body, is_anthropic_route
from kvpilot.server.async_engine import AsyncEngine
from kvpilot.server.fault_metrics import FaultCollector
from kvpilot.server.limits import BodySizeLimit, ServerLimits
from kvpilot.server.metrics import ServerMetrics
from kvpilot.server.ops import OpsConfig
from kvpilot.server.prompt_cache import PromptCache, PromptCacheConfig
from kvpilot.server.protocol import ApiError, ModelCard, ModelList, error_body
from kvpilot.server.registry_store import RegistryStore
from kvpilot.server.session_ops import load_registry, run_expiry
from kvpilot.server.session_registry import SessionRegistry
from kvpilot.server.state import ServerState, get_state, get_tenant
from kvpilot.server.tenancy import ApiKeys
from kvpilot.server.tokenization import Tokenization

log = logging.getLogger("kvpilot.server")


def create_app(
    engine: Engine,
    *,
    model_name: str = "tiny",
    limits: ServerLimits | None = None,
    api_keys: ApiKeys | None = None,
    options: Mapping[str, Any] | None = None,
    prompt_cache: PromptCacheConfig | None = None,
    ops: OpsConfig | None = None,
) -> FastAPI:
    """An app serving ``engine``; its engine thread runs while the app is up (lifespan)."""
    limits = limits or ServerLimits()
    metrics = ServerMetrics(engine.kv.block_size)
    cache = PromptCache(engine, prompt_cache or PromptCacheConfig(), metrics.registry)
    async_engine = AsyncEngine(
        engine, on_iteration=metrics.observe, on_abort=metrics.requests_aborted.inc
    )
    registry, registry_store = _session_registry(engine, limits)
    others = {"usage": cache.ledger.faults}
    if registry_store is not None:
        others["registry"] = registry_store.faults
    metrics.registry.register(FaultCollector(async_engine, others))
    state = ServerState(
        engine=async_engine,
        model_name=model_name,
        max_model_len=engine.max_model_len,
        limits=limits,
        api_keys=api_keys or ApiKeys(),
        metrics=metrics,
        tokenization=Tokenization(engine),
        options=dict(options or {}),
        prompt_cache=cache,
        ops=ops or OpsConfig(),
        sessions=registry,
        registry_store=registry_store,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        async_engine.call_blocking(metrics.observe)
        expiry = asyncio.create_task(run_expiry(state))
        try:
            yield
        finally:
            expiry.cancel()
            async_engine.shutdown()  # also closes the engine (copiers, disk tier)
            state.tokenization.close()
            if state.registry_store is not None:
                state.registry_store.close()
            cache.close()

    app = FastAPI(title="kvpilot", lifespan=lifespan)
    app.state.kvpilot = state
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    _install_error_handlers(app, metrics)
    app.include_router(completions_api.router)
    app.include_router(sessions_api.router)
    app.include_router(messages_api.router)
    app.include_router(usage_api.router)
    app.include_router(health.router)

    @app.get("/v1/models")
    async def models(request: Request, tenant: str | None = Depends(get_tenant)) -> dict:
        s = get_state(request)
        card = ModelCard(id=s.model_name, created=s.created, max_model_len=s.max_model_len)
        return ModelList(data=[card]).model_dump()

    return app


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def reply(status: int, body: dict[str, Any], request: Request | None = None) -> JSONResponse:
        """The OpenAI error body, or Anthropic's on the Anthropic routes."""
        metrics.http_errors.labels(str(status)).inc()
        if request is not None and is_anthropic_route(request.url.path):
            body = anthropic_error_body(status, body)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return reply(exc.status, exc.body(), request)

    @app.exception_handler(SessionNotFound)
    async def session_not_found(request: Request, exc: SessionNotFound) -> JSONResponse:
        body = error_body(str(exc), "not_found_error", "session_id", "session_not_found")
        return reply(404, body, request)

    @app.exception_handler(SessionBusy)
    async def session_busy(request: Request, exc: SessionBusy) -> JSONResponse:
        body = error_body(str(exc), "conflict_error", "session_id", "session_busy")
        return reply(409, body, request)

    @app.exception_handler(SessionQuotaExceeded)
    async def too_many_sessions(request: Request, exc: SessionQuotaExceeded) -> JSONResponse:
        body = error_body(str(exc), "rate_limit_error", code="too_many_sessions")
        response = reply(429, body, request)
        retry = getattr(exc, "retry_after_s", None)
        if retry is not None:
            response.headers["Retry-After"] = str(max(1, math.ceil(retry)))
        return response

    @app.exception_handler(InvalidRequest)
    async def invalid_request(request: Request, exc: InvalidRequest) -> JSONResponse:
        code = "context_length_exceeded" if isinstance(exc, PromptTooLong) else None
        return reply(400, error_body(str(exc), "invalid_request_error", code=code), request)

    @app.exception_handler(KvpilotError)
    async def kvpilot_error(request: Request, exc: KvpilotError) -> JSONResponse:
        return reply(400, error_body(str(exc), "invalid_request_error"), request)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc)
        return reply(400, error_body(message, "invalid_request_error", param=param), request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return reply(exc.status_code, error_body(message, kind), request)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return reply(
            500,
            error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
            request,
        )


def _session_registry(
    engine: Engine, limits: ServerLimits
) -> tuple[SessionRegistry, RegistryStore | None]:
    """The registry, persisted next to the engine's session store when there is a disk tier
    (its records come back after a restart)."""
    store = None
    sessions = engine.offload.session_store
    if sessions is not None:
        store = RegistryStore(sessions.path.parent)
    registry = SessionRegistry(
        max_per_bucket=limits.max_sessions_per_tenant,
        ttl_s=limits.session_ttl_s,
        on_change=store.save if store is not None else None,
        on_remove=store.delete if store is not None else None,
    )
    if store is not None:
        load_registry(registry, store.load())
    return registry, store


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg')}", None
    parts = []
    param = None
    for error in errors[:5]:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        field = ".".join(loc) or "body"
        param = param or (field if loc else None)
        parts.append(f"{field}: {error.get('msg')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "invalid request: " + "; ".join(parts) + more, param
