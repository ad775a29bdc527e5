"""What the server reports about memory tiers and pauses. Every function here reads engine
state, so it runs on the engine thread (inside an `AsyncEngine` command or hook)."""

from __future__ import annotations

import time
from typing import Any

from kvpilot.engine import Engine, Session
from kvpilot.engine.snapshot import EngineSnapshot, TierUsage
from kvpilot.memory import Tier
from kvpilot.memory.hashing import chain_hashes
from kvpilot.units import to_jsonable

TIERS = tuple(t.value for t in Tier)


def pause_info(engine: Engine, session_id: str) -> dict[str, Any] | None:
    """The session's standing pause (action, reason, the figures, state, and when it was
    decided as a Unix time), if it is paused."""
    record = engine.offload.record_for(session_id)
    if record is None:
        return None
    decided_at = time.time() - (engine.clock.now() - record.paused_at)
    return to_jsonable({**record.as_dict(), "decided_at": decided_at})


def session_residency(engine: Engine, session: Session) -> dict[str, Any]:
    """Where the session's KV is: blocks it holds on the device, and, per tier, how many of
    its full blocks have a copy there (a block may have copies in several tiers)."""
    traj = session.traj
    tokens = traj.token_array()
    bs = engine.kv.block_size
    prefix = engine.kv.radix.peek(tokens, traj.salt).blocks_by_tier
    disk = engine.offload.disk
    on_disk = 0
    if disk is not None and len(tokens) >= bs:
        hashes = chain_hashes(tokens, bs, traj.salt, engine.kv.radix.model)
        on_disk = sum(disk.contains(h) for h in hashes)
    return {
        "held_on_device": len(traj.block_table),
        "full_blocks": len(tokens) // bs,
        "device": prefix[Tier.DEVICE] + traj.num_private_blocks,
        "host": prefix[Tier.HOST],
        "disk": on_disk,
    }


def describe_tiers(snap: EngineSnapshot) -> dict[str, Any]:
    """The tiers and pause policy as the engine applied them (for /health)."""
    layout = snap.layout
    host = snap.tiers.get(Tier.HOST.value, TierUsage())
    disk = snap.tiers.get(Tier.DISK.value, TierUsage())
    return {
        "policy": layout.policy,
        "block_bytes": layout.block_bytes,
        "device": {
            "blocks": snap.tiers.get(Tier.DEVICE.value, TierUsage()).num_blocks,
            "block_size": layout.block_size,
        },
        "host": {
            "enabled": layout.host_enabled,
            "blocks": host.num_blocks,
            "bytes": host.num_blocks * layout.block_bytes,
            "link_bw_bytes_s": snap.link_bw_bytes_s,
        },
        "disk": {
            "enabled": layout.disk_enabled,
            "dir": layout.disk_dir,
            "blocks": disk.num_blocks,
            "bw_bytes_s": snap.disk_bw_bytes_s,
        },
        "prefetch": layout.prefetch,
        "default_tool_wait_s": layout.default_tool_wait_s,
    }


def window_kv(snap: EngineSnapshot) -> dict[str, Any] | None:
    """A hybrid model's sliding-window pool (for /health; None without one). Its KV stays on
    the device: released outside the window, or recomputed, never offloaded."""
    w = snap.window
    if w is None:
        return None
    return {
        "window_tokens": w.window_tokens,
        "blocks": w.num_blocks,
        "used": w.used_blocks,
        "held": w.held_blocks,
        "cached": w.cached_blocks,
        "released": w.released_blocks,
        "saved_bytes": w.saved_bytes,
    }
