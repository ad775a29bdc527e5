"""What the router knows about each replica's load, and the request it is routing.

A replica reports a `ReplicaLoad` (with its KV events, or on a timer); between reports the
router adds what it has itself sent there (`ReplicaView.pending_tokens`), so a burst of
requests does not all pick the replica that looked idle a moment ago.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpilot.errors import ConfigError, NoReplicaAvailable

# What a replica that never reported is assumed to manage (replaced by its first report).
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
DEFAULT_LINK_BYTES_PER_S = 16e9
DEFAULT_DISK_BYTES_PER_S = 2e9


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's load and measured rates, as of ``time_s`` (its clock).

    ``waiting_tokens``: prompt tokens queued or running but not yet computed. ``kv_usage``:
    device KV held by requests and sessions (evictable cached blocks do not count). Rates
    and bandwidths are the engine's own measurements (0 bandwidth: no such tier).
    """

    time_s: float = 0.0
    waiting_tokens: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    device_host_bw_bytes_s: float = DEFAULT_LINK_BYTES_PER_S
    host_disk_bw_bytes_s: float = DEFAULT_DISK_BYTES_PER_S
    block_bytes: float = 0.0
    block_size: int = 16


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """A request to place: its whole prompt (a session turn: history + new tokens)."""

    request_id: str
    tokens: Sequence[int]
    salt: str | None = None
    session: str | None = None
    cache_key: str | None = None  # OpenAI's prompt_cache_key
    text: str | None = None  # the prompt text where known (the ray_prefix baseline's key)

    @property
    def affinity(self) -> str | None:
        """What groups this request with others: its session, else its prompt_cache_key."""
        if self.session is not None:
            return f"session:{self.session}"
        if self.cache_key is not None:
            return f"key:{self.salt or ''}:{self.cache_key}"
        return None


@dataclass(slots=True)
class ReplicaView:
    """The router's picture of one replica."""

    name: str
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    live: bool = True
    ongoing: int = 0  # requests this router sent that have not finished (a queue length)
    routed: int = 0
    _pending: deque[tuple[float, int]] = field(default_factory=deque)
    _pending_sum: int = 0

    @property
    def pending_tokens(self) -> int:
        """Tokens routed here that its last report did not yet include."""
        return self._pending_sum

    def on_routed(self, now: float, new_tokens: int) -> None:
        self.ongoing += 1
        self.routed += 1
        self._pending.append((now, new_tokens))
        self._pending_sum += new_tokens

    def on_finished(self) -> None:
        self.ongoing = max(0, self.ongoing - 1)

    def on_report(self, load: ReplicaLoad) -> None:
        self.load = load
        pending = self._pending
        while pending and pending[0][0] <= load.time_s:
            self._pending_sum -= pending.popleft()[1]

    def load_tokens(self) -> float:
        """L_j: queued prompt tokens, reported plus routed since (see `kvpilot.fleet.scoring`)."""
        return float(self.load.waiting_tokens + self._pending_sum)


class FleetView:
    """Every replica the router may choose from, by name, in a stable order."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        self.replicas: dict[str, ReplicaView] = {}
        for name in names:
            self.add(name)

    def add(self, name: str) -> ReplicaView:
        view = self.replicas.get(name)
        if view is None:
            view = self.replicas[name] = ReplicaView(name)
        view.live = True
        return view

    def live(self) -> list[ReplicaView]:
        return [v for v in self.replicas.values() if v.live]

    def __getitem__(self, name: str) -> ReplicaView:
        return self.replicas[name]

    def require_live(self) -> list[ReplicaView]:
        live = self.live()
        if not live:
            raise NoReplicaAvailable(
                f"none of the fleet's {len(self.replicas)} replicas is up to take the request; "
                "retry once one has (re)started"
            )
        return live


def check_positive(name: str, value: float) -> None:
    if not value > 0 or math.isinf(value):
        raise ConfigError(f"{name} must be a positive finite number, got {value}")
