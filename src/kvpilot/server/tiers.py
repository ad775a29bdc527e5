"""What the server reports about memory tiers and pauses. Every function here reads engine
state, so it runs on the engine thread (inside an `AsyncEngine` command or hook)."""

from __future__ import annotations

import math
import time
from array import array
from typing import Any

from kvpilot.engine import Engine, Session
from kvpilot.memory import RadixCache, Tier
from kvpilot.memory.hashing import chain_hashes

TIERS = tuple(t.value for t in Tier)


def jsonable(value: Any) -> Any:
    """JSON-safe: infinite or NaN figures (a break-even wait that never comes) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def pause_info(engine: Engine, session_id: str) -> dict[str, Any] | None:
    """The session's standing pause (action, reason, the figures, state, and when it was
    decided as a Unix time), if it is paused."""
    record = engine.offload.record_for(session_id)
    if record is None:
        return None
    decided_at = time.time() - (engine.clock.now() - record.paused_at)
    return jsonable({**record.as_dict(), "decided_at": decided_at})


def session_residency(engine: Engine, session: Session) -> dict[str, Any]:
    """Where the session's KV is: blocks it holds on the device, and, per tier, how many of
    its full blocks have a copy there (a block may have copies in several tiers)."""
    traj = session.traj
    tokens = traj.token_array()
    bs = engine.kv.block_size
    prefix = _cached_prefix_blocks(engine.kv.radix, tokens, traj.salt)
    disk = engine.offload.disk
    on_disk = 0
    if disk is not None and len(tokens) >= bs:
        hashes = chain_hashes(tokens, bs, traj.salt, engine.kv.radix.model)
        on_disk = sum(disk.contains(h) for h in hashes)
    return {
        "held_on_device": len(traj.block_table),
        "full_blocks": len(tokens) // bs,
        "device": prefix[Tier.DEVICE.value] + traj.num_private_blocks,
        "host": prefix[Tier.HOST.value],
        "disk": on_disk,
    }


def _cached_prefix_blocks(radix: RadixCache, tokens: array, salt: str | None) -> dict[str, int]:
    """Blocks of the longest cached prefix of ``tokens``, counted per tier holding a copy.

    A read-only walk of the tree (``RadixCache.match`` would refresh the path's LRU time
    and may split a node; looking must not change what gets evicted).
    """
    counts = dict.fromkeys(TIERS, 0)
    node = radix.roots().get(salt)
    if node is None:
        return counts
    step = 4 * radix.block_size  # children are keyed by their first block's int32 bytes
    query = tokens.tobytes()
    end = len(tokens) // radix.block_size * step
    offset = 0
    while offset < end:
        child = node.children.get(query[offset : offset + step])
        if child is None:
            break
        edge = child.tokens.tobytes()
        k = 0
        while k * step < len(edge) and offset + (k + 1) * step <= end:
            at = offset + k * step
            if edge[k * step : (k + 1) * step] != query[at : at + step]:
                break
            k += 1
        for tier in child.blocks:
            counts[Tier(tier).value] += k
        if k * step < len(edge):
            break
        node = child
        offset += k * step
    return counts


def describe_tiers(engine: Engine) -> dict[str, Any]:
    """The tiers and pause policy as the engine applied them (for /health)."""
    mover = engine.offload.mover
    config = engine.config
    block_bytes = mover.block_bytes
    host = mover.host_pool
    disk = mover.disk
    return {
        "policy": config.pause_policy,
        "block_bytes": block_bytes,
        "device": {"blocks": engine.kv.device.num_blocks, "block_size": engine.kv.block_size},
        "host": {
            "enabled": host is not None and mover.transport is not None,
            "blocks": host.num_blocks if host is not None else 0,
            "bytes": (host.num_blocks if host is not None else 0) * block_bytes,
            "link_bw_bytes_s": mover.link_bw(),
        },
        "disk": {
            "enabled": disk is not None,
            "dir": config.disk_dir if disk is not None else None,
            "blocks": disk.num_slots if disk is not None else 0,
            "bw_bytes_s": mover.disk_bw(),
        },
        "prefetch": config.prefetch,
        "default_tool_wait_s": config.default_tool_wait_s,
    }
