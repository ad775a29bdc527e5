"""`WindowedSimulatedRunner`: the simulated executor of a hybrid model, with a window pool.

A hybrid model on the real engine keeps its sliding-window layers' KV in a pool of their
own and releases blocks wholly outside the window (`kvpilot.memory.window`); the simulated
engine does the same when its executor declares the group (`WindowExecutor`). The pools are
sized as the real engine sizes them from memory (`kvpilot.sizing.pool_split`). Window KV
is never offloaded, so host and disk tiers (sized on the main pool's blocks) hold only the
full-attention layers' KV.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.engine.clock import VirtualClock
from kvpilot.engine.executor import WindowGroupSpec
from kvpilot.sim.cost_model import StepCostModel
from kvpilot.sim.runner import SimulatedRunner


class WindowedSimulatedRunner(SimulatedRunner):
    """A `SimulatedRunner` that also implements `kvpilot.engine.executor.WindowExecutor`."""

    def __init__(
        self,
        cost: StepCostModel,
        clock: VirtualClock,
        window_group: WindowGroupSpec,
        *,
        num_blocks: int,
        block_size: int | None = None,
        vocab_size: int = 32000,
    ) -> None:
        super().__init__(
            cost, clock, num_blocks=num_blocks, block_size=block_size, vocab_size=vocab_size
        )
        self.window_group: WindowGroupSpec | None = window_group

    def copy_window_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """A fork's tail block copy in the window group: it costs as much as the main one's
        (the cost model prices copies per block of every layer)."""
        del pairs  # priced with the main group's copy of the same block

    def poison_window_blocks(self, blocks: Sequence[int]) -> None:
        """Nothing to poison: simulated blocks hold no KV."""
