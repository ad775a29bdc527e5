"""API keys -> tenants, and the cache salt that keeps tenants' prefixes apart.

A keys file is either JSON (``{"key": "tenant", ...}``) or text with one ``key tenant``
pair per line (blank lines and lines starting with ``#`` are skipped). Keys are kept only as
SHA-256 digests and looked up by digest, so a lookup's timing says nothing about how close
a guess was.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from kvpilot.errors import ConfigError
from kvpilot.server.protocol import ApiError

# The radix cache has one root per salt; a salt is the tenant, or tenant + "/" + cache_salt.
SALT_SEPARATOR = "/"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _check_tenant(name: str, where: str) -> None:
    if not name or any(c.isspace() for c in name) or SALT_SEPARATOR in name:
        raise ConfigError(
            f"{where}: tenant name {name!r} must be non-empty, without spaces or {SALT_SEPARATOR!r}"
        )


class ApiKeys:
    """Which tenant an ``Authorization: Bearer <key>`` header belongs to.

    With no keys configured, authentication is off and every request is the anonymous
    tenant ``None`` (one shared cache namespace).
    """

    def __init__(self, keys: Mapping[str, str] | None = None) -> None:
        self._tenants: dict[bytes, str] = {}
        for key, tenant in (keys or {}).items():
            if not key or any(c.isspace() for c in key):
                raise ConfigError("an API key must be non-empty and contain no whitespace")
            _check_tenant(tenant, "API keys")
            self._tenants[_digest(key)] = tenant

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(self._tenants.values())

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the API keys file {path}: {exc}") from exc
        if text.lstrip().startswith("{"):
            return cls(_parse_json(text, path))
        return cls(_parse_lines(text, path))

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant of an Authorization header; `ApiError` 401 when keys are on and it fails."""
        if not self.enabled:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(
                401,
                "missing API key: send 'Authorization: Bearer <key>' (the OpenAI client's api_key)",
                type="authentication_error",
                code="invalid_api_key",
            )
        tenant = self._tenants.get(_digest(key.strip()))
        if tenant is None:
            raise ApiError(
                401,
                "invalid API key: it is not in this server's --api-keys file",
                type="authentication_error",
                code="invalid_api_key",
            )
        return tenant


def key_id(authorization: str | None) -> str | None:
    """The id the usage ledger records for the caller's key: 12 hex digits of its SHA-256
    (never the key itself); None without a key."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return _digest(key.strip()).hex()[:12]


def cache_salt(tenant: str | None, salt: str | None = None) -> str | None:
    """The engine salt of a request: its tenant, further split by an explicit ``cache_salt``."""
    if salt is None:
        return tenant
    return f"{tenant or ''}{SALT_SEPARATOR}{salt}"


def _parse_json(text: str, path: Path) -> dict[str, str]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise ConfigError(f'{path}: a JSON keys file maps each key to a tenant: {{"key": "team"}}')
    return data


def _parse_lines(text: str, path: Path) -> dict[str, str]:
    keys: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"{path}:{number}: expected 'key tenant', got {len(parts)} fields")
        key, tenant = parts
        if key in keys:
            raise ConfigError(f"{path}:{number}: key listed twice")
        keys[key] = tenant
    return keys
