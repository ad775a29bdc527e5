"""``/health`` (liveness), ``/ready`` (readiness) and ``/metrics`` (Prometheus), and who may
read what.

- ``/health`` answers 200 while the engine loop goes round (its heartbeat is younger than
  `OpsConfig.liveness_s`), 503 otherwise, with the reason: a process supervisor restarts on
  it. Its body describes the engine (KV per tier, tiers, pauses), never a tenant: with API
  keys on it leaves out the session count and the server's options (paths) unless the caller
  holds the metrics key.
- ``/ready`` answers 200 only while new requests are taken (not starting, not stopping).
- ``/metrics`` holds tenant names and per-tenant counts: with API keys on, it needs
  ``Authorization: Bearer <metrics key>`` (``--metrics-key``); without a metrics key it is
  served to loopback clients only.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvpilot.server.protocol import ApiError
from kvpilot.server.state import ServerState, authorization, get_state
from kvpilot.server.tiers import describe_tiers, window_kv

router = APIRouter()


def is_admin(state: ServerState, request: Request) -> bool:
    """The caller holds the metrics key (or, with keys off and no metrics key, anyone)."""
    key = state.ops.metrics_key
    if key is None:
        return not state.api_keys.enabled
    scheme, _, given = (authorization(request) or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip(), key)


def is_loopback(request: Request) -> bool:
    host = request.client.host if request.client is not None else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    s = get_state(request)
    engine = s.engine
    age = engine.heartbeat_age_s()
    alive = engine.running and age <= s.ops.liveness_s
    if alive:
        status = "running"
    elif engine.running:
        status = f"stalled: the engine loop has not gone round for {age:.0f} s"
    else:
        status = engine.stop_reason()
    snap = s.metrics.latest
    body: dict[str, Any] = {
        "status": "ok" if alive else "error",
        "model": s.model_name,
        "engine": status,
        "heartbeat_age_s": round(age, 3),
        "loop_restarts": engine.restarts,
        "step_faults": engine.faults,
        "requests": {"running": snap.running, "waiting": snap.waiting},
        "kv": {
            tier: {"blocks": t.num_blocks, "used": t.used_blocks, "cached": t.cached_blocks}
            for tier, t in snap.tiers.items()
        },
        "window_kv": window_kv(snap),
        "tiers": describe_tiers(snap),
        "pauses": {
            "decisions": snap.pause_decisions,
            "bytes_moved": snap.bytes_moved,
            "prefetch_hits": snap.prefetch_hits,
            "prefetch_stalls": snap.prefetch_stalls,
        },
    }
    if is_admin(s, request):
        body["sessions"] = len(s.sessions)
        body["options"] = s.options
    else:  # where the server keeps its files is the operator's business
        disk = body["tiers"].get("disk")
        if isinstance(disk, dict) and "dir" in disk:
            body["tiers"] = {**body["tiers"], "disk": {**disk, "dir": None}}
    return JSONResponse(body, status_code=200 if alive else 503)


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    s = get_state(request)
    if s.engine.running and not s.draining:
        return JSONResponse({"status": "ready"})
    why = "the server is shutting down" if s.draining else s.engine.stop_reason()
    return JSONResponse({"status": "not ready", "reason": why}, status_code=503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    s = get_state(request)
    if s.api_keys.enabled and not is_admin(s, request):
        if s.ops.metrics_key is not None:
            raise ApiError(
                401,
                "/metrics needs the metrics key: send 'Authorization: Bearer <key>' with the "
                "key given to --metrics-key",
                type="authentication_error",
                code="invalid_api_key",
            )
        if not is_loopback(request):
            raise ApiError(
                403,
                "/metrics is served to loopback clients only while --api-keys is on; start "
                "the server with --metrics-key to read it remotely",
                type="authentication_error",
            )
    return Response(s.metrics.render(), media_type=CONTENT_TYPE_LATEST)
