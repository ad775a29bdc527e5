"""What the fleet simulator keeps per session, per request in flight, and per finished
request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvpilot.engine.request import RequestOutput
from kvpilot.engine.session import Session
from kvpilot.fleet.load import RouteRequest
from kvpilot.fleet.routers import RouteDecision

OnDone = Callable[[RequestOutput], None]


@dataclass(slots=True)
class FleetSession:
    """A session as the fleet sees it: its tokens are the truth, its engine session is
    wherever it last ran (None before its first turn, or after its replica died)."""

    session_id: str
    salt: str | None = None
    replica: str | None = None
    engine_session: Session | None = None
    closed: bool = False

    @property
    def tokens(self) -> list[int]:
        s = self.engine_session
        return s.tokens if s is not None and not s.closed else []


@dataclass(slots=True)
class Pending:
    replica: str
    request: RouteRequest
    fsession: FleetSession | None
    max_tokens: int
    pause: tuple[float | None, str | None] | None
    on_done: OnDone
    arrival_s: float
    ideal_tokens: int
    decision: RouteDecision | None = None


@dataclass(slots=True)
class FleetLog:
    """Per finished request; per replica: computed tokens."""

    replica: list[str] = field(default_factory=list)
    arrival_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    ideal_tokens: list[int] = field(default_factory=list)
    predicted_tokens: list[float] = field(default_factory=list)
