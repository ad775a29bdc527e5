"""Whether a session leaves its overloaded home replica, priced by the break-even rule.

A session's turns go home (where its KV is) unless home is overloaded: its queued prompt
tokens reach ``session_overload * L_max`` (held KV does not count here: a home full of
its own sessions' state is doing its job). Then moving pays only if the queue it escapes
is longer than the queue it joins plus the cost of rebuilding, on the target, the prefix
that only home holds. That cost is the break-even rule's (`kvpilot.policy.breakeven`):
recompute the missing tokens, or reload them from a disk tier the target can read (a
shared folder), whichever the rule finds faster. It is paid twice: the session waits for
its own rebuild, and so does everything queued behind it on the target::

    migrate  iff  wait_home_s > wait_target_s + 2 * move_s,
    wait_s = L / prefill_rate,   move_s = min(recompute_s, disk_reload_s)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.fleet.load import ReplicaView
from kvpilot.fleet.scoring import RouterConfig
from kvpilot.policy.breakeven import PauseAction, PauseInputs, decide_pause


@dataclass(frozen=True, slots=True)
class MigrationDecision:
    """Every figure that decided, and one sentence saying why."""

    migrate: bool
    reason: str
    home: str
    target: str
    home_load_ratio: float
    home_wait_s: float
    target_wait_s: float
    move_s: float
    via: str  # "recompute" or "shared disk"


def _wait_s(view: ReplicaView) -> float:
    rate = view.load.prefill_tokens_per_s
    return view.load_tokens() / rate if rate > 0 else math.inf


def decide_migration(
    home: ReplicaView,
    home_match_tokens: float,
    target: ReplicaView,
    target_match_tokens: float,
    config: RouterConfig,
) -> MigrationDecision:
    """Should the session at ``home`` run this turn on ``target`` instead?"""
    ratio = home.load_tokens() / config.l_max_tokens
    load = target.load
    missing = max(0, int(home_match_tokens - target_match_tokens))
    blocks = -(-missing // max(1, load.block_size))
    figures = decide_pause(
        PauseInputs(
            kv_bytes=float(blocks * load.block_bytes),
            num_tokens=missing,
            expected_wait_s=0.0,
            device_host_bw_bytes_s=load.device_host_bw_bytes_s,
            host_disk_bw_bytes_s=load.host_disk_bw_bytes_s if config.shared_disk else 0.0,
            prefill_tokens_per_s=max(load.prefill_tokens_per_s, 1e-9),
            host_free_bytes=0.0,  # the target cannot read home's host memory
        )
    )
    if figures.via is PauseAction.OFFLOAD_DISK:
        move_s, via = figures.disk_reload_s, "shared disk"
    else:
        move_s, via = figures.recompute_s, "recompute"
    home_wait, target_wait = _wait_s(home), _wait_s(target)

    def decision(migrate: bool, reason: str) -> MigrationDecision:
        return MigrationDecision(
            migrate, reason, home.name, target.name, ratio, home_wait, target_wait, move_s, via
        )

    if ratio < config.session_overload:
        return decision(
            False,
            f"stay: home {home.name} queues {ratio:.2f} of L_max, under the overload "
            f"threshold {config.session_overload:.2f}",
        )
    if home_wait <= target_wait + 2 * move_s:
        return decision(
            False,
            f"stay: home {home.name} is overloaded ({ratio:.2f} of L_max) but its "
            f"{home_wait:.2f} s queue beats {target.name}'s {target_wait:.2f} s plus twice "
            f"the {move_s:.2f} s to {via} {missing} tokens there",
        )
    return decision(
        True,
        f"migrate to {target.name}: home {home.name} queues {home_wait:.2f} s "
        f"({ratio:.2f} of L_max); {target.name} queues {target_wait:.2f} s and needs "
        f"{move_s:.2f} s to {via} the {missing} tokens it lacks",
    )
