"""The HTTP server: OpenAI-compatible API, agent sessions, tenants, Prometheus metrics.

Names are imported lazily, so that light modules of this package (the start-up banner, the
limits `kvpilot serve` parses) load without FastAPI, and `kvpilot --help` stays instant.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpilot.server.app import create_app as create_app
    from kvpilot.server.async_engine import AsyncEngine as AsyncEngine
    from kvpilot.server.async_engine import RequestStream as RequestStream
    from kvpilot.server.limits import ServerLimits as ServerLimits
    from kvpilot.server.tenancy import ApiKeys as ApiKeys

_EXPORTS = {
    "ApiKeys": "kvpilot.server.tenancy",
    "AsyncEngine": "kvpilot.server.async_engine",
    "RequestStream": "kvpilot.server.async_engine",
    "ServerLimits": "kvpilot.server.limits",
    "create_app": "kvpilot.server.app",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpilot.server' has no attribute {name!r}")
    return getattr(import_module(module), name)
