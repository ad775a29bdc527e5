"""The HTTP server: OpenAI-compatible API, agent sessions, tenants, Prometheus metrics."""

from kvpilot.server.app import create_app
from kvpilot.server.async_engine import AsyncEngine, RequestStream
from kvpilot.server.limits import ServerLimits
from kvpilot.server.tenancy import ApiKeys

__all__ = ["ApiKeys", "AsyncEngine", "RequestStream", "ServerLimits", "create_app"]
