"""The engine's side of prompt-cache breakpoints: holding a pinned prefix's KV.

`RadixHolder` is the `kvpilot.promptcache.pins.Holder` of a real (or simulated) engine: a
pinned prefix is held by a radix lock on the node where it ends, counted in
``KVManager.prefix_pins`` so that ``check_invariants`` accounts for it. A locked node is
never evicted and keeps its device copy; releasing the pin makes it ordinary cache again.
`pin_inputs` gives the break-even rule the measured figures for a prefix pinned for a TTL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpilot.memory import KVManager, RadixNode, Tier
from kvpilot.policy.breakeven import PauseInputs
from kvpilot.policy.meters import DEFAULT_PREFILL_TOKENS_PER_S

if TYPE_CHECKING:
    from kvpilot.engine.engine import Engine


class RadixHolder:
    def __init__(self, kv: KVManager) -> None:
        self.kv = kv

    def hold(self, salt: str | None, tokens: Sequence[int]) -> tuple[RadixNode, int] | None:
        match = self.kv.radix.match(list(tokens), salt, record=False)
        if match.num_tokens == 0:
            return None
        self.kv.radix.lock(match.node)
        self.kv.prefix_pins[match.node] += 1
        return match.node, match.num_tokens

    def release(self, handle: RadixNode) -> None:
        pins = self.kv.prefix_pins
        pins[handle] -= 1
        if pins[handle] <= 0:
            del pins[handle]
        self.kv.radix.unlock(handle)


def pin_inputs(engine: Engine, num_tokens: int, ttl_s: float) -> PauseInputs:
    """The break-even rule's inputs for ``num_tokens`` of prefix pinned for ``ttl_s``."""
    offload = engine.offload
    mover = offload.mover
    blocks = -(-num_tokens // engine.kv.block_size)
    host = mover.host_pool
    host_free = 0.0
    if host is not None and mover.transport is not None:
        host_free = (host.num_free + engine.kv.radix.evictable_blocks(Tier.HOST)) * float(
            offload.block_bytes
        )
    return PauseInputs(
        kv_bytes=float(blocks * offload.block_bytes),
        num_tokens=num_tokens,
        expected_wait_s=ttl_s,
        device_host_bw_bytes_s=mover.link_bw(),
        host_disk_bw_bytes_s=mover.disk_bw(),
        prefill_tokens_per_s=offload.prefill.tokens_per_s(num_tokens, DEFAULT_PREFILL_TOKENS_PER_S),
        device_pressure=min(1.0, max(0.0, offload.pressure())),
        host_pressure=host.usage if host is not None else 1.0,
        host_free_bytes=host_free,
    )
