"""The one registry of sessions as clients know them: who owns each, its quota bucket, what
the client has sent, idle expiry, and persistence next to the disk tier.

A session is named by its client (``extra_body.session_id``, created on first use, ids
``[A-Za-z0-9._:-]{1,128}``) or by the server (``POST /v1/sessions``), within its tenant: two
tenants may both have an "agent-1", and neither sees the other's (a lookup across tenants is
a 404, as if the session did not exist). The engine's `Session` holds the tokens and KV under
`engine_id` (the tenant's namespace + the id); this registry holds what HTTP needs on top:
the owner, the chat conversation as of the last turn (so a client may send only its new
messages), counters, and when it was last used. Errors are typed (`SessionNotFound`,
`SessionQuotaExceeded`) and mapped to 404 / 429 in one place (`app.py`).

Quotas count open sessions per bucket: a tenant, or, with no API keys, each client address
(so one anonymous client cannot exhaust the others). Sessions idle longer than the TTL
expire; a refused client is told when the bucket's oldest idle session will
(``Retry-After``). Touched only from the event loop.
"""

from __future__ import annotations

import re
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvpilot.errors import InvalidRequest, SessionNotFound, SessionQuotaExceeded
from kvpilot.server.protocol import SESSION_ID_PATTERN

_SESSION_ID = re.compile(SESSION_ID_PATTERN)
TENANT_SEPARATOR = "/"  # tenant names never hold it (`tenancy._check_tenant`)

Bucket = tuple[str, str]  # ("tenant", name) or ("client", address)


class TooManySessions(SessionQuotaExceeded):
    """A quota refusal, with when to retry (the bucket's oldest idle session expires)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def check_session_id(session_id: str) -> None:
    if not _SESSION_ID.match(session_id):
        raise InvalidRequest(
            f"session id {session_id[:140]!r} is not valid: use 1 to 128 of A-Z a-z 0-9 . _ : -"
        )


def engine_session_id(tenant: str | None, session_id: str) -> str:
    """The engine's id of a tenant's session (ids are scoped per tenant)."""
    return session_id if tenant is None else f"{tenant}{TENANT_SEPARATOR}{session_id}"


def client_session_id(tenant: str | None, engine_id: str) -> str:
    prefix = "" if tenant is None else f"{tenant}{TENANT_SEPARATOR}"
    return engine_id[len(prefix) :] if prefix and engine_id.startswith(prefix) else engine_id


@dataclass(slots=True)
class ServerSession:
    session_id: str
    tenant: str | None
    cache_salt: str | None
    bucket: Bucket = ("tenant", "")
    messages: list[dict[str, Any]] = field(default_factory=list)
    opening_tokens: list[int] = field(default_factory=list)
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_tier: Counter[str] = field(default_factory=Counter)
    last_divergence_index: int | None = None
    last_pause: dict[str, Any] | None = None
    last_used: float = field(default_factory=time.time)
    busy: int = 0  # requests of this session in flight (an active session never expires)

    @property
    def engine_id(self) -> str:
        return engine_session_id(self.tenant, self.session_id)

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
        self.last_used = time.time()

    def forked(self, session_id: str) -> ServerSession:
        return ServerSession(
            session_id,
            self.tenant,
            self.cache_salt,
            bucket=self.bucket,
            messages=list(self.messages),
            opening_tokens=list(self.opening_tokens),
            turns=self.turns,
        )


def bucket_of(tenant: str | None, client: str | None) -> Bucket:
    """Whose quota a session counts against: its tenant, or its anonymous client's address."""
    if tenant is not None:
        return ("tenant", tenant)
    return ("client", client or "unknown")


class SessionRegistry:
    """Sessions by (tenant, id); optionally persisted (``on_change`` / ``on_remove``)."""

    def __init__(
        self,
        *,
        max_per_bucket: int = 256,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[ServerSession], None] | None = None,
        on_remove: Callable[[ServerSession], None] | None = None,
    ) -> None:
        self.max_per_bucket = max_per_bucket
        self.ttl_s = ttl_s
        self.clock = clock
        self.on_change = on_change
        self.on_remove = on_remove
        self._sessions: dict[tuple[str | None, str], ServerSession] = {}
        self._per_bucket: Counter[Bucket] = Counter()

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[ServerSession]:
        return iter(list(self._sessions.values()))

    @staticmethod
    def new_id() -> str:
        return f"sess-{secrets.token_hex(8)}"

    def check_quota(self, bucket: Bucket, wanted: int = 1) -> None:
        """`TooManySessions` unless ``wanted`` more sessions fit the bucket's quota."""
        open_now = self._per_bucket[bucket]
        if open_now + wanted <= self.max_per_bucket:
            return
        now = self.clock()
        idle = [
            s.last_used + self.ttl_s - now
            for s in self._sessions.values()
            if s.bucket == bucket and not s.busy
        ]
        retry = max(1.0, min(idle)) if idle else self.ttl_s
        who = "this tenant" if bucket[0] == "tenant" else "this client"
        raise TooManySessions(
            f"{who} has {open_now} open sessions and the limit is {self.max_per_bucket}: close "
            "one with DELETE /v1/sessions/{id}, or retry when an idle one expires "
            f"(in {retry:.0f} s)",
            retry,
        )

    def add(self, session: ServerSession) -> ServerSession:
        check_session_id(session.session_id)
        key = (session.tenant, session.session_id)
        if key in self._sessions:
            raise InvalidRequest(f"session id {session.session_id!r} is already in use")
        self._sessions[key] = session
        self._per_bucket[session.bucket] += 1
        self.changed(session)
        return session

    def find(self, session_id: str, tenant: str | None) -> ServerSession | None:
        return self._sessions.get((tenant, session_id))

    def get(self, session_id: str, tenant: str | None) -> ServerSession:
        session = self._sessions.get((tenant, session_id))
        if session is None:
            raise SessionNotFound(
                f"no session {session_id!r}: name one in extra_body.session_id to create it, "
                "or create one with POST /v1/sessions"
            )
        return session

    def changed(self, session: ServerSession) -> None:
        if self.on_change is not None:
            self.on_change(session)

    def remove(self, session_id: str, tenant: str | None) -> ServerSession | None:
        session = self._sessions.pop((tenant, session_id), None)
        if session is not None:
            self._per_bucket[session.bucket] -= 1
            if self.on_remove is not None:
                self.on_remove(session)
        return session

    def of_tenant(self, tenant: str | None) -> list[ServerSession]:
        return [s for s in self._sessions.values() if s.tenant == tenant]

    def expired(self) -> list[ServerSession]:
        """Sessions idle (no request in flight) for longer than the TTL."""
        cutoff = self.clock() - self.ttl_s
        return [s for s in self._sessions.values() if not s.busy and s.last_used < cutoff]

    def restore(self, sessions: list[ServerSession]) -> None:
        """Records loaded from disk after a restart (not written back)."""
        for session in sessions:
            key = (session.tenant, session.session_id)
            if key not in self._sessions:
                self._sessions[key] = session
                self._per_bucket[session.bucket] += 1
