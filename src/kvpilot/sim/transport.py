"""`SimulatedTransport`: the engine's device<->host tier on virtual time.

Copies take ``blocks * block_bytes / link_bytes_per_s`` on a full-duplex link: one queue per
direction, so a copy starts when the previous one in its direction is done. A copy completes
in the background (`done` turns true once the clock passes its finish); a caller that waits
on an unfinished copy (``result``) advances the clock to its finish, which is the stall the
real engine would see. ``block_bytes`` and the link are per device of the TP group: every
device moves its share of each block over its own host link at the same time.

Disk moves cross the same link (``read_device`` before a disk write, ``write_device`` after
a disk read, as through host staging memory); the disk itself is `kvpilot.sim.disk`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpilot.engine.clock import VirtualClock
from kvpilot.errors import ConfigError


class SimulatedTransfer:
    """A copy on the virtual clock (satisfies `kvpilot.engine.executor.Transfer`)."""

    __slots__ = ("clock", "finish_s", "seconds", "value")

    def __init__(
        self, clock: VirtualClock, finish_s: float, seconds: float, value: Any = None
    ) -> None:
        self.clock = clock
        self.finish_s = finish_s
        self.seconds = seconds
        self.value = seconds if value is None else value  # what ``result`` answers

    def done(self) -> bool:
        return self.clock.now() >= self.finish_s

    def result(self, timeout: float | None = None) -> Any:
        self.clock.advance_to(self.finish_s)
        return self.value


class SimulatedTransport:
    """Implements `kvpilot.engine.executor.TierTransport` on the virtual clock.

    ``sync_loads`` False: no load is waited for inside a step (`kvpilot.engine.tier_loader.
    SYNC_LOAD_MAX_S`): the simulator's fast paths (decode runs, idle skips) move the clock at
    step boundaries only, and must give the same results as stepping one by one.
    """

    sync_loads = False

    def __init__(
        self,
        clock: VirtualClock,
        *,
        num_host_blocks: int,
        block_bytes: int,
        link_bytes_per_s: float,
    ) -> None:
        if num_host_blocks < 0 or block_bytes < 1 or link_bytes_per_s <= 0:
            raise ConfigError(
                "a simulated host tier needs num_host_blocks >= 0, block_bytes >= 1 and a "
                "positive link bandwidth"
            )
        self.clock = clock
        self.num_host_blocks = num_host_blocks
        self.block_bytes = block_bytes
        self.link_bytes_per_s = link_bytes_per_s
        self.bytes_out = 0
        self.bytes_in = 0
        self._free_at = {"out": 0.0, "in": 0.0}

    def _copy(self, direction: str, blocks: int) -> SimulatedTransfer:
        nbytes = blocks * self.block_bytes
        seconds = nbytes / self.link_bytes_per_s
        start = max(self.clock.now(), self._free_at[direction])
        finish = start + seconds
        self._free_at[direction] = finish
        if direction == "out":
            self.bytes_out += nbytes
        else:
            self.bytes_in += nbytes
        return SimulatedTransfer(self.clock, finish, seconds)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> SimulatedTransfer:
        return self._copy("out", len(pairs))

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> SimulatedTransfer:
        return self._copy("in", len(pairs))

    def read_device(self, blocks: Sequence[int]) -> SimulatedTransfer:
        """Device blocks out to staging memory, for a disk write (a stand-in per block)."""
        copy = self._copy("out", len(blocks))
        return SimulatedTransfer(self.clock, copy.finish_s, copy.seconds, [b""] * len(blocks))

    def write_device(self, blocks: Sequence[int], data: Sequence[bytes]) -> SimulatedTransfer:
        """Blocks read from disk, in to the device."""
        return self._copy("in", len(blocks))

    def poison_host(self, blocks: Sequence[int]) -> None:
        """Nothing to poison: simulated blocks hold no KV."""
