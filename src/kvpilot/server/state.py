"""What every route needs: the engine loop, limits, tenants, sessions, metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from kvpilot.server.async_engine import AsyncEngine
from kvpilot.server.limits import ServerLimits
from kvpilot.server.metrics import ServerMetrics
from kvpilot.server.ops import OpsConfig
from kvpilot.server.prompt_cache import PromptCache
from kvpilot.server.registry_store import RegistryStore
from kvpilot.server.session_registry import SessionRegistry
from kvpilot.server.tenancy import ApiKeys
from kvpilot.server.tokenization import Tokenization


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    model_name: str
    max_model_len: int
    limits: ServerLimits
    api_keys: ApiKeys
    metrics: ServerMetrics
    tokenization: Tokenization  # prompts -> tokens on a worker pool
    sessions: SessionRegistry = field(default_factory=SessionRegistry)
    prompt_cache: PromptCache | None = None
    # Options accepted on the command line and how the engine took them, shown by /health.
    options: dict[str, Any] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    ops: OpsConfig = field(default_factory=OpsConfig)
    draining: bool = False  # shutting down: /ready fails, new requests get 503
    registry_store: RegistryStore | None = None  # the session registry on disk


def get_state(request: Request) -> ServerState:
    return request.app.state.kvpilot


def authorization(request: Request) -> str | None:
    """The caller's credentials: ``Authorization: Bearer <key>``, or Anthropic's
    ``x-api-key: <key>`` (what the official anthropic client sends)."""
    header = request.headers.get("authorization")
    if header is None and (key := request.headers.get("x-api-key")):
        header = f"Bearer {key}"
    return header


def client_address(request: Request) -> str | None:
    """The client's address: anonymous clients' session quota is counted per address."""
    return request.client.host if request.client is not None else None


def get_tenant(request: Request) -> str | None:
    """FastAPI dependency: the caller's tenant (401 when keys are configured and it fails)."""
    return get_state(request).api_keys.tenant_for(authorization(request))
