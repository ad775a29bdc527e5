"""A trajectory's integrity audit (`Trajectory.check_invariants`): its locked path, table,
counts and window table against each other and the prefix cache."""

from __future__ import annotations

from array import array
from typing import Protocol

from kvpilot.errors import require
from kvpilot.memory.radix import RadixCache, RadixNode
from kvpilot.memory.tiers import Tier
from kvpilot.memory.window_table import WindowTable


class AuditedTrajectory(Protocol):
    """What the audit reads of a `Trajectory`."""

    traj_id: int
    salt: str | None
    closed: bool
    tokens: array
    block_table: list[int]
    num_computed_tokens: int
    locked_tokens: int
    num_private_blocks: int
    locked_node: RadixNode
    window: WindowTable | None
    _bs: int
    _radix: RadixCache


def check_trajectory(traj: AuditedTrajectory) -> None:
    """AssertionError on the first thing about ``traj`` that does not add up."""
    if traj.closed:
        require(not traj.block_table, f"closed trajectory {traj.traj_id} holds blocks")
        require(traj.num_computed_tokens == 0, f"closed trajectory {traj.traj_id} has KV")
        return
    bs = traj._bs
    tid = traj.traj_id
    node = traj.locked_node
    require(node.alive, f"trajectory {tid} locks an evicted node")
    top = node
    while top.parent is not None:
        top = top.parent
    require(top is traj._radix.root(traj.salt), f"trajectory {tid} locks another salt's path")
    require(
        traj.tokens[: node.depth_tokens] == node.path_tokens(),
        f"trajectory {tid}: its locked path holds other tokens than its own",
    )
    computed = traj.num_computed_tokens
    require(computed <= len(traj.tokens), f"trajectory {tid}: computed beyond its tokens")
    require(computed <= len(traj.block_table) * bs, f"trajectory {tid}: KV not covered")
    require(node.depth_tokens <= computed, f"trajectory {tid}: locked path beyond computed")
    shared = node.depth_tokens // bs
    require(
        traj.locked_tokens == node.depth_tokens
        and traj.num_private_blocks == len(traj.block_table) - shared,
        f"trajectory {tid}: locked_tokens {traj.locked_tokens} or num_private_blocks "
        f"{traj.num_private_blocks} drifted from its locked node and table",
    )
    require(
        traj.block_table[:shared] == node.path_blocks(Tier.DEVICE),
        f"trajectory {tid}: shared prefix differs from its locked path's blocks",
    )
    require(
        len(set(traj.block_table)) == len(traj.block_table),
        f"trajectory {tid}: a block appears twice in its table",
    )
    if traj.window is not None:
        traj.window.check(tid, computed, len(traj.block_table))
