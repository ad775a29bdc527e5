"""What the pause rule is told in the engine: the pressure a state faces, when an idle
session is next used, how much host room is really free, which idle state memory pressure
demotes, the device blocks an idle session holds, and the fallback when a fixed policy asks
for a tier the engine lacks. Pure functions over `PauseRecord`s, the `PauseBook`'s running
tallies of them, and trajectories."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

from kvpilot.engine.pause_book import PauseBook
from kvpilot.engine.tier_stats import PauseRecord
from kvpilot.memory import Tier, Trajectory
from kvpilot.policy.breakeven import PauseAction, PauseDecision

# Module constants: an enum member's class attribute lookup is slow, and every pause reads these.
DEVICE, HOST = Tier.DEVICE, Tier.HOST
OFFLOAD_HOST, OFFLOAD_DISK = PauseAction.OFFLOAD_HOST, PauseAction.OFFLOAD_DISK


def held_blocks(traj: Trajectory) -> int:
    """Device blocks only ``traj`` holds: its private tail and the device copies of the
    deepest part of its path no one else locks (`Residency.exclusive_nodes`), walked inline:
    the step loop samples this for every idle session."""
    node = traj.locked_node
    blocks = traj.num_private_blocks
    while node.depth_tokens and node.lock_count == 1:  # depth 0: the root
        device = node.blocks.get(DEVICE)
        if device is not None:
            blocks += len(device)
        node = node.parent  # type: ignore[assignment]  # only the root has none
    return blocks


def next_use(record: PauseRecord, now: float) -> float:
    """When a paused session is expected back. Overdue: a wait past its prediction is a long
    one (approvals, slow tools), so expect it to last as long again rather than end at once."""
    return max(record.expected_return, now + (now - record.paused_at))


def pressure_on(
    pressure: float, book: PauseBook, now: float, kv_bytes: float, wait: float
) -> float:
    """The device pressure this pause's state faces: the engine's, times the share of
    retained idle state that is back sooner than it. When memory is needed, `reclaim`
    demotes whatever is back last first, so state that others would give way for is under
    no pressure itself; the one back last feels it all."""
    # min(1.0, max(0.0, pressure)), without two builtin calls (~1.5k instructions each):
    # max(a, b) is ``b if b > a else a`` and min(a, b) ``b if b < a else a``, NaN included.
    pressure = pressure if pressure > 0.0 else 0.0
    pressure = pressure if pressure < 1.0 else 1.0
    sooner = book.retained_back_by(now + wait, now)
    later = book.retained_bytes - sooner
    if later == 0.0:
        return pressure
    return pressure * (sooner + kv_bytes) / (sooner + later + kv_bytes)


def working_bytes(used: float, evictable: float, book: PauseBook) -> float:
    """Device bytes of the work a recompute would stall: what is in use, less the prefix
    cache (evictable) and less the state idle sessions hold (they compute nothing)."""
    idle = book.retained_bytes + book.prefetched_bytes
    working = used - evictable - idle
    return working if working > 0.0 else 0.0  # max(0.0, working): see `pressure_on`


def host_room(
    free_or_evictable_bytes: float, capacity_bytes: float, book: PauseBook
) -> tuple[float, float]:
    """(free bytes, pressure) of the host tier. Host room is what LRU may evict, less what
    paused sessions offloaded there and will want back: those bytes are held, not cache
    (`host.usage` counts both)."""
    awaited = book.host_awaited_bytes
    # max and min written out (see `pressure_on`): this is read by every pause.
    free = free_or_evictable_bytes - awaited
    free = free if free > 0.0 else 0.0
    used = 1.0 - free / (1.0 if capacity_bytes < 1.0 else capacity_bytes)
    used = used if used > 0.0 else 0.0
    return free, (used if used < 1.0 else 1.0)


def host_room_of(pool: Any, radix: Any, block_bytes: int, book: PauseBook) -> tuple[float, float]:
    """`host_room` of a host block pool (None: no host tier, no room, full pressure)."""
    if pool is None:
        return 0.0, 1.0
    free = (pool.num_free + radix.evictable_blocks(HOST)) * block_bytes
    return host_room(free, pool.num_blocks * block_bytes, book)


def feasible(decision: PauseDecision, host_bw: float, disk_bw: float) -> PauseDecision:
    """A fixed policy may ask for a tier this engine lacks: fall back to drop, and say so."""
    action = decision.action
    if action is OFFLOAD_HOST and host_bw == 0.0:
        why = "no host tier is configured"
    elif action is OFFLOAD_DISK and disk_bw == 0.0:
        why = "no disk tier is configured"
    else:
        return decision
    reason = (
        f"Drop: the policy chose {action.label.lower()} but {why}, so the state is freed "
        "now and recomputed on return."
    )
    return dataclasses.replace(decision, action=PauseAction.DROP, reason=reason)


class Idle(Protocol):
    session_id: str
    last_used: float


S = TypeVar("S", bound=Idle)


def pick_demotion(sessions: Sequence[S], records: Mapping[str, PauseRecord], now: float) -> S:
    """The idle session memory pressure demotes: the one expected back last (a session never
    paused counts from when it was last used, as long again).

    This is the rule's own order for the way out memory pressure takes: per byte freed, a
    host copy costs the same round trip whoever it is, so the memory-time saved beyond the
    break-even wait is largest for the state back last. (Measured on bench_pause's simulated
    node, pricing each candidate's way out by host room instead, dropping those with no room
    there, recomputed more: see docs/architecture.md.)
    """

    def back_at(s: S) -> float:
        record = records.get(s.session_id)
        return now + (now - s.last_used) if record is None else next_use(record, now)

    return max(sessions, key=back_at)


def demoted_to_host(decision: PauseDecision) -> PauseDecision:
    """A retained state memory pressure moved to host: awaited there like an offload (so host
    room counts it as held, and it is prefetched back)."""
    reason = (
        f"Offload to host (demoted under memory pressure after: {decision.reason[:1].lower()}"
        f"{decision.reason[1:]})"
    )
    return dataclasses.replace(decision, action=PauseAction.OFFLOAD_HOST, reason=reason)


def disk_demotion_reload_s(
    kv_bytes: float, num_tokens: int, link_bw: float, disk_bw: float, prefill_tokens_per_s: float
) -> float | None:
    """The reload time from disk of a state memory pressure demotes when the host has no
    room for it, or None when the disk is no way out: no disk tier, or its round trip
    (written now, read back at the return, at min(link, disk) as in the rule) takes longer
    than recomputing the state on its return."""
    bw = min(link_bw, disk_bw)
    if bw <= 0.0 or kv_bytes <= 0.0 or prefill_tokens_per_s <= 0.0:
        return None
    reload_s = kv_bytes / bw
    return reload_s if 2 * reload_s < num_tokens / prefill_tokens_per_s else None


def demoted_to_disk(decision: PauseDecision, reload_s: float) -> PauseDecision:
    """A retained state memory pressure moved to disk (the host had no room): awaited there
    like an offload to disk, prefetched back at its return."""
    reason = (
        f"Offload to disk (demoted under memory pressure, no host room, after: "
        f"{decision.reason[:1].lower()}{decision.reason[1:]})"
    )
    return dataclasses.replace(
        decision,
        action=PauseAction.OFFLOAD_DISK,
        reason=reason,
        disk_reload_s=reload_s,
        disk_round_trip_s=2 * reload_s,
    )


def reload_of(decision: PauseDecision) -> float:
    """The time to bring back a state offloaded as ``decision`` says (host or disk)."""
    if decision.action is PauseAction.OFFLOAD_DISK:
        return decision.disk_reload_s
    return decision.reload_s


def demoted_to(decision: PauseDecision, disk_reload_s: float | None) -> PauseDecision:
    """`demoted_to_disk` when reclaim wrote the state to disk (it has its reload time),
    else `demoted_to_host`."""
    if disk_reload_s is None:
        return demoted_to_host(decision)
    return demoted_to_disk(decision, disk_reload_s)
