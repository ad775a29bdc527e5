"""A trajectory's branches and rewinds: `fork` (a child sharing the parent's full blocks,
copy-on-write for its partial tail) and `truncate` (a resent history that diverged).

The bodies of `Trajectory.fork` and `Trajectory.truncate`, kept apart from the per-step
paths in trajectory.py; they work on the trajectory's own bookkeeping (its lock, table,
counts and high-water mark) as its methods would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.errors import InvalidRequest, OutOfBlocks

if TYPE_CHECKING:
    from kvpilot.memory.trajectory import Trajectory


@dataclass(frozen=True, slots=True)
class ForkResult:
    """A fork's child, the (src, dst) block copy its partial tail needs, and whether it was
    deferred (opened on the parent's tokens with no KV: it recomputes its tail from the cache)."""

    child: Trajectory
    copy: tuple[int, int] | None
    deferred: bool = False
    window_copy: tuple[int, int] | None = None  # the same copy in the window group


def fork_trajectory(traj: Trajectory) -> ForkResult:
    """Figure 5: ``traj``'s child shares every full block and gets its own copy of the partial
    tail (`Trajectory.fork`)."""
    traj._require_open()
    traj.commit()
    n_full, tail = divmod(traj.num_computed_tokens, traj._bs)
    pool = traj._pool
    window = traj.window
    dst: int | None = None
    window_dst: int | None = None
    if tail:
        if window is not None:
            window_dst = window.pool.allocate(1)[0]
        try:
            if pool.num_free < 1:
                traj._radix.evict(1)
            dst = pool.allocate(1)[0]
        except OutOfBlocks:
            if window is not None and window_dst is not None:
                window.pool.release([window_dst])
            raise
    manager = traj._manager
    child = type(traj)(manager, manager.next_trajectory_id(), traj.salt, traj.tokens)
    shared = traj.block_table[:n_full]  # the parent's locked path (committed just now)
    child.block_table = shared if dst is None else [*shared, dst]
    child._lock_to(traj.locked_node)  # and counts its blocks
    child.num_computed_tokens = child._settled = traj.num_computed_tokens  # not by a step
    window_copy = None
    if window is not None:
        child.window = window.forked(n_full, window_dst)
        if window_dst is not None:
            window_copy = (window.blocks[n_full], window_dst)
    manager.register(child)
    copy = None if dst is None else (traj.block_table[n_full], dst)
    return ForkResult(child, copy, window_copy=window_copy)


def truncate_trajectory(traj: Trajectory, num_tokens: int) -> None:
    """Rewind to the first ``num_tokens`` tokens (a client resent a history that diverged).

    Every full block before the cut stays where it is (held, or in the prefix cache);
    only the partial block at the cut is recomputed.
    """
    traj._require_open()
    if not 0 <= num_tokens <= len(traj.tokens):
        raise InvalidRequest(
            f"cannot truncate trajectory {traj.traj_id} of {len(traj.tokens)} tokens "
            f"to {num_tokens}"
        )
    window = traj.window
    if window is not None:
        window.forget_hashes(num_tokens // traj._bs)
    if num_tokens < traj.num_computed_tokens:
        bs = traj._bs
        keep = num_tokens // bs
        if window is not None:  # back to where the window group's KV is whole
            keep = window.longest_valid(keep, traj.num_computed_tokens, traj.tokens)
        shared = traj.locked_tokens // bs
        if keep < shared:
            # The cut falls inside the shared path: lock only its first ``keep`` blocks
            # (matching splits the node at that block boundary; the whole locked path is
            # on device, so the match ends exactly there and no block turns private).
            match = traj._radix.match(traj.tokens[: keep * bs], traj.salt, record=False)
            traj._lock_to(match.node)
        extra = traj.block_table[max(keep, shared) :]  # the private blocks past the cut
        if keep == 0 and traj.block_table:
            traj._manager.resident_trajectories -= 1
        del traj.block_table[keep:]
        traj._pool.decref_many(extra)
        if window is not None:
            window.truncate(keep)
            window.adopt(keep, traj.num_computed_tokens, traj.tokens)
        traj._peak = traj.high_water()
        traj.num_computed_tokens = traj._settled = keep * bs
        traj._recount()
    del traj.tokens[num_tokens:]
