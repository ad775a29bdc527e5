"""Memory pressure: an idle session's state gives way (`reclaim`, what the session table's
`reclaim_idle` calls when admission needs room).

One demotion per call, least value per byte held first (`pause_pricing.pick_demotion`): to
host, to disk when the host has no room and the disk's round trip beats a recompute, else to
the prefix cache, where eviction takes it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from kvpilot.engine import pause_pricing as pricing
from kvpilot.engine.tier_stats import MoveKind, PauseState
from kvpilot.memory import RadixNode, Tier, Trajectory
from kvpilot.policy.meters import DEFAULT_PREFILL_TOKENS_PER_S

if TYPE_CHECKING:
    from kvpilot.engine.offload import OffloadManager, PausableSession


def reclaim(offload: OffloadManager, idle: Seq[PausableSession]) -> int:
    """Memory pressure, with idle state to demote (``offload``'s sessions ``idle``); returns
    0 when nothing gave way (the scheduler stops asking), else 1.

    Copies out to host already under way (a pause's offload) free their blocks first:
    wait for them and demote nothing more this call (copies to disk are not waited for:
    they run at the disk's speed, slower than demoting a state to host). Else demote the
    idle trajectory back last (`pricing.pick_demotion`) to host (the copy waited for),
    awaited there like an offload; when the host has no room for it, to disk if its round
    trip beats a recompute (`pricing.disk_demotion_reload_s`, the write waited for); else
    to the prefix cache, where eviction takes it. A state prefetched back and demoted
    again still has its host copy: nothing is copied, and it is awaited there like any
    demotion to host (held, not LRU room; prefetched back)."""
    holders = [s for s in idle if s.traj.block_table and offload.held_bytes(s.traj)]
    if not holders:
        return 0
    moves = offload.mover.moves
    if moves and all(m.kind is MoveKind.HOST for m in moves):
        # Demoting would wait for them too (`wait_moves`): their blocks may be enough.
        offload.mover.wait_moves()
        return 1
    now = offload.now()
    victim = pricing.pick_demotion(holders, offload.records, now)
    nodes = offload.exclusive_device_nodes(victim.traj)
    disk_reload_s = _disk_demotion(offload, victim.traj, nodes)
    victim.traj.release_kv(keep_in_cache=True)
    record = offload.records.get(victim.session_id)
    if record is not None:
        offload.timers.cancel(victim.session_id)
        offload.records.change(record, PauseState.CACHED)
    tier = "cache"
    if disk_reload_s is not None and offload.mover.write_disk(nodes) is not None:
        offload.mover.hint_disk(victim.traj)
        tier = "disk"
    elif offload.mover.has_host and nodes and offload.mover.swap_out(nodes) is not None:
        tier = "host"
    elif nodes and all(Tier.HOST in n.blocks for n in nodes):
        tier = "host"  # already there (a prefetched state): nothing to copy
    if tier != "cache":
        offload.mover.wait_moves()
        if record is not None:
            to_disk = disk_reload_s if tier == "disk" else None
            demoted = pricing.demoted_to(record.decision, to_disk)
            offload.records.change(record, PauseState.CACHED, demoted)
            record.expected_return = pricing.next_use(record, now)
            offload.offloaded(victim, record, pricing.reload_of(record.decision))
    offload.stats.decisions["demoted"] += 1
    offload.stats.demoted_to[tier] += 1
    return 1


def _disk_demotion(
    offload: OffloadManager, traj: Trajectory, nodes: list[RadixNode]
) -> float | None:
    """The disk reload time when reclaim should demote these nodes to disk: the host has
    no room for them without evicting state awaited there, a disk tier exists and its
    round trip beats recomputing them; else None."""
    mover, bb = offload.mover, offload.block_bytes
    if mover.disk is None or mover.transport is None or not nodes:
        return None
    kv_bytes = sum(n.num_blocks for n in nodes) * bb
    if pricing.host_room_of(offload.host, offload.radix, bb, offload.records)[0] >= kv_bytes:
        return None
    rate = offload.prefill.tokens_per_s(len(traj.tokens), DEFAULT_PREFILL_TOKENS_PER_S)
    tokens = sum(len(n.tokens) for n in nodes)
    return pricing.disk_demotion_reload_s(
        kv_bytes, tokens, mover.device_link_bw(), mover.disk_bw(), rate
    )
