"""Where a pinned prefix lives: the cheapest tier whose reload still beats recompute.

A pin is a pause whose length is known in advance (its TTL, at most, until the next hit),
so it is priced by the same break-even rule as a paused session (`policy/breakeven.py`):
retain on the device when memory is plentiful or the TTL is too short for a move to pay
for itself, offload to host or disk when it does and that tier reloads faster than the
prefix recomputes. Where the rule would drop the state (no tier reloads faster than
recompute), a pin stays on the device: a breakpoint asks for the prefix to be kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.policy.breakeven import PauseAction, PauseDecision, PauseInputs, decide_pause

TIER_OF_ACTION = {
    PauseAction.RETAIN: "device",
    PauseAction.OFFLOAD_HOST: "host",
    PauseAction.OFFLOAD_DISK: "disk",
    PauseAction.DROP: "device",
    PauseAction.CACHE: "device",
}


@dataclass(frozen=True, slots=True)
class Placement:
    tier: str  # "device", "host" or "disk"
    reason: str
    decision: PauseDecision


def place_pin(inputs: PauseInputs) -> Placement:
    """The tier for a prefix pinned for ``inputs.expected_wait_s`` (its TTL)."""
    decision = decide_pause(inputs)
    tier = TIER_OF_ACTION[decision.action]
    reason = decision.reason
    if decision.action is PauseAction.DROP:
        reason = (
            "Keep on device: no lower tier reloads this prefix faster than it recomputes, "
            "and a breakpoint asks for it to be kept. " + decision.reason
        )
    return Placement(tier, reason, decision)
