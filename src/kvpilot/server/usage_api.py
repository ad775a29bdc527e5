"""``GET /v1/usage?start=...&end=...``: the caller's usage ledger, per hour, key and model.

``start`` and ``end`` are Unix seconds or ISO 8601 times (``2025-06-01T10:00:00Z``); by
default the last 24 hours. A tenant sees only its own rows.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Depends, Request

from kvpilot.promptcache.ledger import totals
from kvpilot.server.protocol import ApiError
from kvpilot.server.state import get_state, get_tenant

router = APIRouter()
DEFAULT_WINDOW_S = 86_400.0


def _time(value: str | None, name: str, default: float) -> float:
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise ApiError(
            400,
            f"{name}={value!r} is neither Unix seconds nor an ISO 8601 time "
            "(e.g. 2025-06-01T10:00:00Z)",
            param=name,
        ) from None


@router.get("/v1/usage")
async def usage(
    request: Request,
    start: str | None = None,
    end: str | None = None,
    tenant: str | None = Depends(get_tenant),
) -> dict[str, Any]:
    state = get_state(request)
    cache = state.prompt_cache
    if cache is None:
        raise ApiError(404, "this server keeps no usage ledger", type="not_found_error")
    now = cache.config.wall_clock()
    end_s = _time(end, "end", now + 1)
    start_s = _time(start, "start", end_s - DEFAULT_WINDOW_S)
    if end_s <= start_s:
        raise ApiError(400, f"end ({end_s:.0f}) must be after start ({start_s:.0f})", param="end")
    rows = cache.ledger.query(tenant, start_s, end_s)
    return {
        "object": "usage",
        "tenant": tenant,
        "start_time": start_s,
        "end_time": end_s,
        "data": [r.to_json() for r in rows],
        "totals": totals(rows),
        "generated_at": int(time.time()),
    }
