"""Telemetry of pauses and tier moves, the states they go through, and the record a pause
leaves on its session."""

from __future__ import annotations

import enum
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field

from kvpilot.memory import Tier
from kvpilot.policy.breakeven import PauseAction, PauseDecision, PauseInputs

DIRECTIONS = ("device_to_host", "host_to_device", "device_to_disk", "disk_to_device")


class PauseState(enum.StrEnum):
    """Where a paused session's KV is now.

    RETAINED (held on the device, maybe under a lease) -> CACHED when the lease runs out;
    OFFLOADED (moving or moved to host or disk) -> LOADING (a prefetch started) ->
    PREFETCHED (back on the device before the session returned); DROPPED (freed, recomputed
    on return); CACHED (unlocked, left to the prefix cache's LRU; also what memory pressure
    demotes an idle session to).
    """

    RETAINED = "retained"
    OFFLOADED = "offloaded"
    DROPPED = "dropped"
    CACHED = "cached"
    LOADING = "loading"
    PREFETCHED = "prefetched"


class MoveKind(enum.StrEnum):
    HOST = "host"  # device -> host copy
    DISK = "disk"  # device -> bytes -> disk store


class MoveStage(enum.Enum):
    COPY = "copy"  # one transfer (device <-> host)
    READ = "read"  # reading bytes (device blocks out, or disk blocks in)
    WRITE = "write"  # writing them (to the disk store, or into device blocks)


@dataclass(slots=True)
class TierStats:
    decisions: Counter[str] = field(default_factory=Counter)
    demoted_to: Counter[str] = field(default_factory=Counter)  # "host", "disk" or "cache"
    bytes_moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    prefetch_hits: int = 0
    prefetch_stalls: int = 0
    recomputed_tokens: int = 0
    idle_gb_s: float = 0.0  # memory-time held on device by idle trajectories
    reload_s: list[float] = field(default_factory=list)
    resume_ttft_s: list[float] = field(default_factory=list)
    loaded_tokens: dict[Tier, int] = field(default_factory=lambda: {Tier.HOST: 0, Tier.DISK: 0})
    disk_misses: int = 0  # blocks expected on disk that were missing or corrupt
    _reload_p50: tuple[int, float] = (0, math.nan)  # (samples it was computed over, value)

    def reload_p50_s(self) -> float:
        """Median time to bring a prefix back (recomputed only when a load finished)."""
        n, value = self._reload_p50
        if n != len(self.reload_s):
            value = statistics.median(self.reload_s) if self.reload_s else math.nan
            self._reload_p50 = (len(self.reload_s), value)
        return value

    def as_dict(self) -> dict[str, object]:
        return {
            "decisions": dict(self.decisions),
            "demoted_to": dict(self.demoted_to),
            "bytes_moved": dict(self.bytes_moved),
            "prefetch_hits": self.prefetch_hits,
            "prefetch_stalls": self.prefetch_stalls,
            "recomputed_tokens": self.recomputed_tokens,
            "idle_gb_s": self.idle_gb_s,
            "loaded_tokens": {str(t): n for t, n in self.loaded_tokens.items()},
            "disk_misses": self.disk_misses,
        }


@dataclass(slots=True)
class PauseRecord:
    """What a pause decided, from what, and where the state is now."""

    session_id: str
    decision: PauseDecision
    inputs: PauseInputs
    tool: str | None
    wait_source: str
    paused_at: float
    expected_return: float
    lease_until: float
    state: PauseState
    prefetch_at: float | None = None

    @property
    def action(self) -> PauseAction:
        return self.decision.action

    @property
    def reason(self) -> str:
        return self.decision.reason

    def as_dict(self) -> dict[str, object]:
        d = self.decision
        return {
            "action": str(d.action),
            "reason": d.reason,
            "state": str(self.state),
            "tool": self.tool,
            "expected_wait_s": self.inputs.expected_wait_s,
            "wait_source": self.wait_source,
            "kv_bytes": self.inputs.kv_bytes,
            "num_tokens": self.inputs.num_tokens,
            "device_pressure": self.inputs.device_pressure,
            "host_pressure": self.inputs.host_pressure,
            "link_bw_bytes_s": self.inputs.device_host_bw_bytes_s,
            "disk_bw_bytes_s": self.inputs.host_disk_bw_bytes_s,
            "prefill_tokens_per_s": self.inputs.prefill_tokens_per_s,
            "reload_s": d.reload_s,
            "recompute_s": d.recompute_s,
            "round_trip_s": d.round_trip_s,
            "break_even_wait_s": d.break_even_wait_s,
            "held_gb_s": d.held_gb_s,
        }
