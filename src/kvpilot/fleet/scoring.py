"""The seed's affinity-load objective, with the match weighted by tier.

For a prompt of S tokens and replica j::

    score_j = mu * (Match_j / S) - (1 - mu) * (L_j / L_max) ** gamma

``Match_j`` counts the leading blocks j holds: a device-resident block fully, a host or
disk block by the fraction of its recompute time that reloading it saves,
``w_tier = max(0, 1 - reload_s / recompute_s)`` per block, from j's measured prefill rate
and link bandwidths (disk reads come through host: ``min(B_link, B_disk)``).
``L_j`` is j's queued prompt work in tokens (reported waiting tokens plus what the router
sent since) plus the device KV its requests and sessions hold (``kv_weight * usage *
L_max``: resident sessions are decode work to come), raised by KV pressure: past
``kv_soft`` of device KV held, admission will soon hold work back, so usage between
``kv_soft`` and 1 adds up to ``L_max`` more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.errors import ConfigError
from kvpilot.fleet.directory import TierMatch
from kvpilot.fleet.load import ReplicaLoad, ReplicaView


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The objective's weights and the session rules.

    Defaults from `bench_fleet.py --study` (4 replicas of llama-3-70b on 8xH100 at ~80%
    load): at equal hit rate (0.999-1.000 of ideal for every point), L_max = 16k tokens gave
    the most even fleet (imbalance 1.09 vs 1.13 at 32k and 64k); mu = 0.5 to 0.9 and gamma
    = 1 or 2 moved imbalance by 0.02 at most. Sessions migrating at lower overload
    thresholds (1 to 4 x L_max) cost hit rate and tail latency in every run: recomputing a
    moved history is load the target did not have.

    ``mu``: weight of the hit ratio against load, in [0, 1]. ``gamma``: how sharply load
    is penalised (>= 1: a convex penalty). ``l_max_tokens``: queued prompt tokens that count
    as a full queue. ``kv_weight``: how much held device KV (a fraction) counts as load.
    ``kv_soft``: device KV usage from which memory pressure counts as extra load.
    ``session_overload``: L/L_max past which a session's home replica is overloaded and the
    session may migrate. ``shared_disk``: replicas read each other's disk tier, so a
    migrating session's prefix may be reloaded instead of recomputed.
    """

    mu: float = 0.7
    gamma: float = 2.0
    l_max_tokens: float = 16384.0
    kv_weight: float = 1.0
    kv_soft: float = 0.8
    session_overload: float = 8.0
    shared_disk: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.mu <= 1.0:
            raise ConfigError(f"router mu must be in [0, 1], got {self.mu}")
        if not self.gamma >= 1.0 or math.isinf(self.gamma):
            raise ConfigError(f"router gamma must be a finite number >= 1, got {self.gamma}")
        if not self.l_max_tokens > 0 or math.isinf(self.l_max_tokens):
            raise ConfigError(f"router L_max must be a positive token count: {self.l_max_tokens}")
        if not self.kv_weight >= 0 or math.isinf(self.kv_weight):
            raise ConfigError(f"router kv_weight must be >= 0, got {self.kv_weight}")
        if not 0.0 <= self.kv_soft < 1.0:
            raise ConfigError(f"router kv_soft must be in [0, 1), got {self.kv_soft}")
        if not self.session_overload > 0:
            raise ConfigError("router session_overload must be positive")


def tier_weights(load: ReplicaLoad) -> tuple[float, float]:
    """(host, disk) weight of one matched block against a device-resident one."""
    if load.block_bytes <= 0 or load.prefill_tokens_per_s <= 0:
        return 0.0, 0.0
    recompute_s = load.block_size / load.prefill_tokens_per_s

    def weight(bw: float) -> float:
        if bw <= 0:
            return 0.0
        return max(0.0, 1.0 - (load.block_bytes / bw) / recompute_s)

    link = load.device_host_bw_bytes_s
    return weight(link), weight(min(link, load.host_disk_bw_bytes_s))


def matched_tokens(match: TierMatch | None, load: ReplicaLoad) -> float:
    """Match_j in device-equivalent tokens."""
    if match is None:
        return 0.0
    w_host, w_disk = tier_weights(load)
    return load.block_size * (match.device + w_host * match.host + w_disk * match.disk)


def load_ratio(view: ReplicaView, config: RouterConfig) -> float:
    """L_j / L_max: queued prompt tokens over L_max, plus the device KV held (a fraction),
    weighted ``kv_weight``, plus the pressure past ``kv_soft``."""
    usage = view.load.kv_usage
    pressure = max(0.0, usage - config.kv_soft) / (1.0 - config.kv_soft)
    return view.load_tokens() / config.l_max_tokens + config.kv_weight * usage + pressure


def score(match_tokens: float, prompt_tokens: int, ratio: float, config: RouterConfig) -> float:
    hit = match_tokens / prompt_tokens if prompt_tokens else 0.0
    return config.mu * hit - (1.0 - config.mu) * ratio**config.gamma
