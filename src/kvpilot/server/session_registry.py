"""The server's view of agent sessions: who owns each one, and what the client has sent.

The engine's `Session` holds the tokens and KV; this registry adds what HTTP needs on top:
the owning tenant (another tenant's lookups answer 404, as if the session did not exist),
the chat conversation as of the last turn (so a client may send only its new messages),
and per-session counters. Touched only from the event loop.
"""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvpilot.server.protocol import ApiError


@dataclass(slots=True)
class ServerSession:
    session_id: str
    tenant: str | None
    cache_salt: str | None
    messages: list[dict[str, Any]] = field(default_factory=list)
    opening_tokens: list[int] = field(default_factory=list)
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_tier: Counter[str] = field(default_factory=Counter)
    last_divergence_index: int | None = None
    last_pause: dict[str, Any] | None = None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def record_turn(
        self, prompt_tokens: int, cached_tokens: int, by_tier: dict[str, int] | None = None
    ) -> None:
        self.turns += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.cached_tokens_by_tier.update(by_tier or {})

    def forked(self, session_id: str) -> ServerSession:
        return ServerSession(
            session_id,
            self.tenant,
            self.cache_salt,
            messages=list(self.messages),
            opening_tokens=list(self.opening_tokens),
            turns=self.turns,
        )


class SessionRegistry:
    def __init__(self) -> None:
        self._sessions: dict[str, ServerSession] = {}
        self._per_tenant: Counter[str | None] = Counter()

    def __len__(self) -> int:
        return len(self._sessions)

    @staticmethod
    def new_id() -> str:
        return f"sess-{secrets.token_hex(8)}"

    def count(self, tenant: str | None) -> int:
        return self._per_tenant[tenant]

    def add(self, session: ServerSession) -> None:
        self._sessions[session.session_id] = session
        self._per_tenant[session.tenant] += 1

    def get(self, session_id: str, tenant: str | None) -> ServerSession:
        session = self._sessions.get(session_id)
        if session is None or session.tenant != tenant:
            raise ApiError(
                404,
                f"no session {session_id!r}: create one with POST /v1/sessions",
                type="not_found_error",
                param="session_id",
                code="session_not_found",
            )
        return session

    def remove(self, session_id: str) -> ServerSession | None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._per_tenant[session.tenant] -= 1
        return session

    def ids(self) -> list[str]:
        return list(self._sessions)

    def of_tenant(self, tenant: str | None) -> list[ServerSession]:
        return [s for s in self._sessions.values() if s.tenant == tenant]
