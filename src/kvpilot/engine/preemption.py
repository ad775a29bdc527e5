"""Preemption that keeps what it can (seed §7: tier-aware victim choice).

A running sequence that must give way for an older one is preempted in one of two ways:

- **swap**: its committed prefix is copied to the host tier and its device blocks freed; on
  readmission the prefix is loaded back (the scheduler's ``ensure_resident`` path, the same
  loader that brings back paused sessions' state);
- **recompute**: its committed prefix is left in the device prefix cache (where eviction
  may take it) and whatever is gone is recomputed on readmission.

Which one is the break-even rule's *way out* (`decide_pause`, the ``via`` it considers):
swap when the host has room and reloading costs less than recomputing. Victims are chosen by
what they cost to bring back per device block they free (a reload round trip for a swap,
the prefill time otherwise), so the cheapest state to restore gives way first; a sequence
whose blocks are all shared frees nothing and goes last.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvpilot.memory import Tier
from kvpilot.policy.breakeven import (
    ENGINE_THRESHOLDS,
    PauseAction,
    PauseDecision,
    decide_pause,
)

if TYPE_CHECKING:
    from kvpilot.engine.offload import OffloadManager
    from kvpilot.engine.request import Sequence
    from kvpilot.memory import RadixNode, Trajectory


class SwapPreemption:
    """The scheduler's ``preempt_cost`` and ``swap_out`` hooks, over the pause machinery."""

    def __init__(self, offload: OffloadManager) -> None:
        self.offload = offload
        self.mover = offload.mover

    def decide(self, traj: Trajectory, nodes: list[RadixNode]) -> PauseDecision:
        """The break-even rule on this sequence's exclusive state (device pressure 1: the
        state leaves the device either way, so only the way out matters)."""
        inputs = self.offload.pause_inputs(traj, nodes, 0.0)
        return decide_pause(inputs, ENGINE_THRESHOLDS)

    def cost_per_block(self, seq: Sequence) -> float:
        """Seconds to bring ``seq`` back, per device block preempting it frees."""
        traj = seq.traj
        nodes = self.offload.exclusive_device_nodes(traj)
        blocks = sum(n.num_blocks for n in nodes) + traj.num_private_blocks
        if blocks <= 0:
            return math.inf
        decision = self.decide(traj, nodes)
        if decision.via is PauseAction.OFFLOAD_HOST:
            return decision.round_trip_s / blocks
        return decision.recompute_s / blocks

    def swap_out(self, seq: Sequence) -> bool:
        """Release ``seq``'s KV to the host tier when the rule says reloading is cheaper, and
        say whether it did; False (nothing done) when the rule says recompute."""
        if not self.mover.has_host:
            return False
        traj = seq.traj
        traj.commit()  # its full blocks join the radix, where the mover can copy them
        nodes = self.offload.exclusive_device_nodes(traj)
        if not nodes or self.decide(traj, nodes).via is not PauseAction.OFFLOAD_HOST:
            return False
        traj.release_kv(keep_in_cache=True)
        if self.mover.swap_out(nodes) is not None:
            self.mover.wait_moves()  # the blocks are wanted now
        # Nodes that kept a host copy from an earlier swap need no new copy: drop their device
        # copies too, so the whole prefix leaves the device. Nodes the host had no room for
        # stay in the device cache (eviction decides; recomputed if it takes them).
        on_host = [n for n in nodes if n.alive and Tier.HOST in n.blocks]
        self.offload.kv.residency.drop_device_copies(on_host)
        return bool(on_host)
