"""The device blocks idle sessions hold, kept as one total and re-walked only where it changed.

The offload manager samples the memory-time of idle state every second: the sum over idle
sessions of `pause_pricing.held_blocks` (private tail plus the device copies of the part of
the radix path only the session locks). The figure of a session that stays idle almost never
changes, so the tally keeps each session's figure from its last walk, and their total, and a
sample re-walks only the sessions the memory core logged a change for since the last one
(O(changes), not O(idle sessions)). A walk remembers where it went:

    root ... --> stop --> ... --> locked      (its trajectory's locked node)
                 lock_count != 1  \\_ segment: lock_count == 1, all locked by it alone _/
                 (or the root)

What can change the figure, and the log that names the session:

- its trajectory's locked node or table length (a release, rewind, reload, fork's commit,
  allocation): the trajectory appends itself to ``Trajectory.held_log`` (`_recount`,
  `allocate`). Its commit growing the locked leaf in place moves blocks from the tail to
  the segment, the same sum: not logged.
- a segment node's lock count going 1 -> 2 (someone else locks into it), or ``stop``'s
  going 2 -> 1 (its last other holder lets go; it joins the segment): the radix logs every
  node whose count crosses between 1 and 2 (`RadixCache.watch_locks`), and the tally finds
  the session by the node (``_owner``: segment node -> session; ``_stopped``: stop -> the
  sessions whose walk stopped there). Nodes above ``stop`` matter only once ``stop`` has
  crossed, which is logged.
- a segment node split: the upper part is a node the tally does not know, so the radix logs
  the split node (the deeper part, which keeps its identity) and its session is re-walked.

Nothing else changes the figure: a locked node never loses its device copy (`drop_copy`
refuses, eviction skips it) nor gains one, and only the lock holder extends its leaf.
The hypothesis state machine in tests/test_idle_held.py holds the total to walking every
idle session after each change.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from kvpilot.engine.pause_pricing import held_blocks
from kvpilot.errors import require
from kvpilot.memory import RadixCache, RadixNode, Trajectory
from kvpilot.memory.tiers import DEVICE


class IdleSession(Protocol):
    """What the tally reads of an idle session (`kvpilot.engine.session.Session`)."""

    session_id: str
    traj: Trajectory


class _Held:
    """One idle session's last walk: its figure, its segment and where it stopped."""

    __slots__ = ("blocks", "segment", "stop", "traj")

    def __init__(self, traj: Trajectory) -> None:
        self.traj = traj
        self.blocks = 0  # walked at the next sample (a session may start its turn before one)
        self.segment: list[RadixNode] = []
        self.stop: RadixNode | None = None

    def walk(self) -> int:
        """`pause_pricing.held_blocks`, remembering the segment and where it ends."""
        traj = self.traj
        node = traj.locked_node
        blocks = traj.num_private_blocks
        segment = []
        while node.depth_tokens and node.lock_count == 1:  # depth 0: the root
            device = node.blocks.get(DEVICE)
            if device is not None:
                blocks += len(device)
            segment.append(node)
            node = node.parent  # type: ignore[assignment]  # only the root has none
        self.segment = segment
        self.stop = node
        self.blocks = blocks
        return blocks


class IdleHeld:
    """The idle sessions (open, between turns) and the device blocks only each one holds."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        self._by_traj: dict[Trajectory, _Held] = {}
        self._owner: dict[RadixNode, _Held] = {}
        self._stopped: dict[RadixNode, set[_Held]] = {}
        self._total = 0
        self._radix: RadixCache | None = None
        # The memory core's logs (emptied by every `_update`).
        self._traj_log: list[Trajectory] = []
        self._node_log: list[RadixNode] = []

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._held

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def idle(self, session: IdleSession) -> None:
        """``session`` is between turns (opened, forked, or its turn ended)."""
        sid = session.session_id
        if sid in self._held:
            self.busy(sid)
        traj = session.traj
        if traj.radix is not self._radix:
            self._watch(traj.radix)
        held = _Held(traj)
        self._held[sid] = held
        self._by_traj[traj] = held
        traj.held_log = log = self._traj_log
        log.append(traj)  # walked at the next sample
        if len(log) + len(self._node_log) > 4 * len(self._held) + 256:
            self._update()  # no sample reads the logs: keep them in proportion

    def _watch(self, radix: RadixCache) -> None:
        if self._radix is not None:
            raise ValueError(
                "the idle-held tally watches one radix cache; this session's is another"
            )
        radix.watch_locks(self._node_log)
        self._radix = radix

    def busy(self, session_id: str) -> None:
        """The session started a turn, or closed."""
        held = self._held.pop(session_id, None)
        if held is None:
            return
        if held.stop is not None:  # walked
            self._forget(held)
            self._total -= held.blocks
        if self._by_traj.get(held.traj) is held:
            del self._by_traj[held.traj]
            held.traj.held_log = None
        if not self._held and self._radix is not None:  # no figure to keep: stop the logs
            self._radix.watch_locks(None)
            self._radix = None
            self._traj_log.clear()
            self._node_log.clear()

    def blocks(self) -> int:  # hot path: every idle memory-time sample
        """Device blocks idle sessions hold, each only by itself: the sum of
        `pause_pricing.held_blocks` over them (re-walking only the ones logged)."""
        if self._traj_log or self._node_log:
            self._update()
        return self._total

    def _update(self) -> None:
        """Re-walk every idle session a logged change may have touched."""
        stale: dict[_Held, None] = {}  # insertion-ordered, each once
        by_traj = self._by_traj
        for traj in self._traj_log:
            held = by_traj.get(traj)
            if held is not None:
                stale[held] = None
        self._traj_log.clear()  # the trajectories hold this very list
        owner = self._owner
        stopped = self._stopped
        for node in self._node_log:
            held = owner.get(node)
            if held is not None:
                stale[held] = None
            waiting = stopped.get(node)
            if waiting:
                stale.update(dict.fromkeys(waiting))
        self._node_log.clear()
        for held in stale:
            if held.stop is not None:  # walked before
                self._forget(held)
            old = held.blocks
            self._total += held.walk() - old
            for node in held.segment:
                owner[node] = held
            stop = held.stop
            if stop is not None and stop.depth_tokens:  # a root's count never crosses
                stopped.setdefault(stop, set()).add(held)

    def _forget(self, held: _Held) -> None:
        """Take ``held``'s last walk out of the node indexes."""
        owner = self._owner
        for node in held.segment:
            if owner.get(node) is held:
                del owner[node]
        stop = held.stop
        assert stop is not None
        if stop.depth_tokens:  # a root is not indexed
            waiting = self._stopped[stop]
            waiting.discard(held)
            if not waiting:
                del self._stopped[stop]

    def check_invariants(self) -> None:
        """After a sample's update, every kept figure equals a fresh walk (`held_blocks`), the
        total is their sum, and the node indexes name exactly the walks' segments and stops."""
        self.blocks()
        for sid, held in self._held.items():
            walked = held_blocks(held.traj)
            require(
                held.blocks == walked,
                f"idle session {sid}: kept {held.blocks} held blocks, a walk finds {walked}",
            )
        kept = sum(held.blocks for held in self._held.values())
        require(self._total == kept, f"idle held total {self._total} drifted from {kept}")
        segments = {node: held for held in self._held.values() for node in held.segment}
        require(self._owner == segments, "idle held: the segment index drifted from the walks")
        stops: dict[RadixNode, set[_Held]] = {}
        for held in self._held.values():
            if held.stop is not None and held.stop.depth_tokens:
                stops.setdefault(held.stop, set()).add(held)
        require(self._stopped == stops, "idle held: the stop index drifted from the walks")
