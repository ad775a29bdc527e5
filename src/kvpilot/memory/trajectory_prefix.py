"""Changes of a trajectory's cached prefix: adopting a longer one the prefix cache holds (a
hit, `Trajectory.reuse_prefix`) and rewinding to a prefix of its tokens when a client resent
a history that diverged (`Trajectory.truncate`), keeping every full block before the cut."""

from __future__ import annotations

from array import array
from typing import Protocol

from kvpilot.errors import InvalidRequest
from kvpilot.memory.block_pool import BlockPool
from kvpilot.memory.radix import RadixCache, RadixNode
from kvpilot.memory.tiers import Tier
from kvpilot.memory.window_table import WindowTable


class _Registry(Protocol):
    resident_trajectories: int


class PrefixedTrajectory(Protocol):
    """What these read and change of a `Trajectory` (its own bookkeeping)."""

    traj_id: int
    salt: str | None
    tokens: array
    block_table: list[int]
    num_computed_tokens: int
    locked_tokens: int
    window: WindowTable | None
    _bs: int
    _radix: RadixCache
    _pool: BlockPool
    locked_node: RadixNode
    _peak: int
    _settled: int

    @property
    def _manager(self) -> _Registry: ...

    def _require_open(self) -> None: ...

    def _lock_to(self, node: RadixNode) -> None: ...

    def _recount(self) -> None: ...

    def high_water(self) -> int: ...


def adopt_cached_prefix(traj: PrefixedTrajectory, end: int) -> None:
    """Match ``traj``'s first ``end`` tokens below its locked node and adopt what is cached
    past the KV computed so far (`Trajectory.reuse_prefix`)."""
    match = traj._radix.match(
        traj.tokens, traj.salt, record=False, below=traj.locked_node, length=end
    )
    window = traj.window
    computed = traj.num_computed_tokens
    if window is not None and match.num_tokens > computed:
        # A hit must also hold the window group's KV of its last W tokens.
        k = window.longest_valid(match.num_tokens // traj._bs, computed, traj.tokens)
        if k * traj._bs < match.num_tokens:
            match = traj._radix.match(traj.tokens[: k * traj._bs], traj.salt, record=False)
    if match.num_tokens > computed:
        shared = traj.locked_tokens // traj._bs
        new_blocks = match.blocks(Tier.DEVICE)
        traj._lock_to(match.node)
        table = traj.block_table
        pool = traj._pool
        overlap = min(len(table), len(new_blocks))
        for i in range(shared, overlap):  # private blocks the locked path now covers
            pool.decref(table[i])
            table[i] = new_blocks[i]
        if not table and new_blocks:  # the table turns non-empty
            traj._manager.resident_trajectories += 1
        table.extend(new_blocks[overlap:])  # held by the lock
        traj._recount()
        if window is not None:
            window.adopt(match.num_tokens // traj._bs, computed, traj.tokens)
        traj._peak = traj.high_water()  # a prefix hit is not KV computed by a step
        traj.num_computed_tokens = traj._settled = match.num_tokens


def truncate_trajectory(traj: PrefixedTrajectory, num_tokens: int) -> None:
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
