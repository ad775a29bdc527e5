"""The device blocks idle sessions hold, kept per session and re-checked in O(1) per sample.

The offload manager samples the memory-time of idle state every second: the sum over idle
sessions of `pause_pricing.held_blocks` (private tail plus the device copies of the part of
the radix path only the session locks). Walking every idle session's path each sample costs
more than everything else the sample does; the figure of a session that stays idle almost
never changes. So each idle session keeps the figure of its last walk together with what
the walk saw, and a sample re-walks only the sessions where that no longer holds:

    root ... --> stop --> top --> ... --> locked      (its trajectory's locked node)
                 lock_count != 1   \\_ lock_count == 1 _/
                 (or the root)      the exclusive part (empty: top is None)

The walk result is unchanged while (1) the trajectory locks the same node and has as many
blocks in its table, (2) ``top`` still has exactly one lock and ``stop`` is still its
parent, and (3) ``stop`` is the root or still has more than one lock. Why that suffices:
lock counts never decrease towards the root (a node counts the locks on its subtree), so
``top`` at one lock means every node between it and ``locked`` has one, ours; a split only
inserts nodes (the deeper part keeps its identity), so ``top`` is still an ancestor of
``locked``, and the blocks below ``stop`` are the same blocks whatever the pieces; a locked
node never loses its device copy (`RadixCache.drop_copy` refuses, eviction skips it), and
only the lock holder extends its leaf (moving blocks from its private tail to the node,
whose sum is the same). Whatever else changes the figure (someone else locking into the
exclusive part or splitting ``top``, the last other holder of ``stop`` letting go, the
trajectory releasing, rewinding or reloading its KV) breaks one of the three checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from kvpilot.engine.pause_pricing import held_blocks
from kvpilot.errors import require
from kvpilot.memory import RadixNode, Tier, Trajectory


class IdleSession(Protocol):
    """What the tally reads of an idle session (`kvpilot.engine.session.Session`)."""

    session_id: str
    traj: Trajectory


DEVICE = Tier.DEVICE  # a module constant: an enum member's class attribute lookup is slow


class _Held:
    """One idle session's last walk: its figure and the nodes that bound it."""

    __slots__ = ("blocks", "locked", "stop", "table", "top", "traj")

    def __init__(self, traj: Trajectory) -> None:
        self.traj = traj
        # Walked at the first sample (a session may start its next turn before one).
        self.locked: RadixNode | None = None
        self.table = -1
        self.top: RadixNode | None = None
        self.stop: RadixNode = traj.locked_node
        self.blocks = 0

    def fresh(self) -> bool:
        """Would a walk now give ``blocks`` again? (The three checks of the module docstring.)"""
        traj, top, stop = self.traj, self.top, self.stop
        return (
            traj.locked_node is self.locked
            and len(traj.block_table) == self.table
            and (top is None or (top.lock_count == 1 and top.parent is stop))
            and (not stop.depth_tokens or stop.lock_count != 1)
        )

    def walk(self) -> int:
        """`pause_pricing.held_blocks`, remembering where the exclusive part ends."""
        traj = self.traj
        node = self.locked = traj.locked_node
        self.table = len(traj.block_table)
        blocks = traj.num_private_blocks
        top = None
        while node.depth_tokens and node.lock_count == 1:  # depth 0: the root
            device = node.blocks.get(DEVICE)
            if device is not None:
                blocks += len(device)
            top = node
            node = node.parent  # type: ignore[assignment]  # only the root has none
        self.top = top
        self.stop = node
        self.blocks = blocks
        return blocks


class IdleHeld:
    """The idle sessions (open, between turns) and the device blocks only each one holds."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._held

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def idle(self, session: IdleSession) -> None:
        """``session`` is between turns (opened, forked, or its turn ended)."""
        self._held[session.session_id] = _Held(session.traj)

    def busy(self, session_id: str) -> None:
        """The session started a turn, or closed."""
        self._held.pop(session_id, None)

    def blocks(self) -> int:  # hot path: every idle memory-time sample
        """Device blocks idle sessions hold, each only by itself: the sum of
        `pause_pricing.held_blocks` over them (re-walking only the stale ones)."""
        total = 0
        for held in self._held.values():
            total += held.blocks if held.fresh() else held.walk()
        return total

    def check_invariants(self) -> None:
        """Every figure the checks would keep equals a fresh walk (`held_blocks`)."""
        for sid, held in self._held.items():
            if held.fresh():
                walked = held_blocks(held.traj)
                require(
                    held.blocks == walked,
                    f"idle session {sid}: kept {held.blocks} held blocks, a walk finds {walked}",
                )
