"""The simulated engine's KV pools, sized as `kvpilot plan` and the real engine size them.

A full-attention model gets one pool: what the plan leaves on one device of the TP group
(HBM minus weights minus reserve), in blocks of every layer (equation 1), unless
``SimSetup.kv_blocks`` overrides it.

A hybrid model whose window layers the engine releases (`RunnerConfig.release_window_blocks`,
on by default) gets two, as the real engine keeps them (`kvpilot.memory.window`): a main
pool of blocks of the full-attention layers only, and a window pool of blocks of the window
layers only, split by `kvpilot.sizing.pool_split.split_pool` with the plan's per-layer
bytes (`hybrid_blocks`). With ``kv_blocks`` given, the window pool defaults to as many
blocks plus the null block (as `ModelRunner` does) unless ``window_kv_blocks`` says.
Window KV never leaves the device, so host and disk tiers hold main-pool blocks; as on the
real engine, a model with no full-attention layer keeps one pool of every layer when it has
such a tier (the tiers would otherwise have nothing to hold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.engine.executor import WindowGroupSpec
from kvpilot.sizing.capacity import block_sizing, memory_budget
from kvpilot.sizing.layers import STATE
from kvpilot.sizing.pool_split import hybrid_blocks, split_pool

if TYPE_CHECKING:
    from kvpilot.sim.build import SimSetup


@dataclass(frozen=True, slots=True)
class SimPools:
    """The main pool's blocks and block bytes (what host and disk tiers hold), and the window
    group (None: one pool of every layer)."""

    main_blocks: int
    main_block_bytes: int
    window: WindowGroupSpec | None = None


def host_kv_bytes(setup: SimSetup) -> float:
    """Host memory per device for the host tier (0: none; a measured profile has none unless
    it is given)."""
    host = setup.host_kv_bytes_per_device
    if host is not None:
        return host
    return 0.0 if setup.profile is not None else setup.parsed_node().accelerator.host_mem_bytes / 2


def sim_pools(setup: SimSetup) -> SimPools:
    """The pools of the module docstring."""
    g, tp, bs = setup.geometry(), setup.tp_degree(), setup.block_size()
    runner = setup.engine.runner
    hybrid = hybrid_blocks(g, tp, bs) if runner.release_window_blocks else None
    one_pool_block = bs * g.bytes_per_token(tp)
    if hybrid and not hybrid.main_block_bytes and host_kv_bytes(setup) >= one_pool_block:
        hybrid = None  # no full-attention layer, and a host tier: one pool, as on the engine

    def pool_bytes() -> float:
        node = setup.parsed_node()
        return memory_budget(g, node, tp, setup.reserve_bytes_per_device).pool_bytes_per_device

    if hybrid is None:
        blocks = setup.kv_blocks
        if blocks is None:
            blocks = block_sizing(pool_bytes(), g.bytes_per_token(tp), bs, 0).num_blocks
        return SimPools(blocks, one_pool_block)
    if setup.kv_blocks is not None:
        main, window = setup.kv_blocks, runner.window_kv_blocks or setup.kv_blocks + 1
    else:
        sched = setup.engine.scheduler
        split = split_pool(
            pool_bytes(),
            hybrid.main_block_bytes,
            hybrid.window_block_bytes,
            window_tokens=hybrid.window_tokens,
            block_size=bs,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            longest_tokens=setup.model_len(),
        )
        main, window = split.main_blocks, split.window_blocks
    spec = WindowGroupSpec(hybrid.window_tokens, window, hybrid.window_block_bytes)
    return SimPools(main, hybrid.main_block_bytes, spec)


def pool_warnings(setup: SimSetup) -> tuple[str, ...]:
    """What the pools simplify about a hybrid model (nothing for a full-attention one)."""
    g = setup.geometry()
    if not g.is_hybrid:
        return ()
    out = []
    windows = sorted({w.window_tokens for w in g.window_groups if w.window_tokens})
    pools = sim_pools(setup)
    if windows and pools.window is None:
        why = (
            "release_window_blocks is off"
            if not setup.engine.runner.release_window_blocks
            else "it has no full-attention layer and a host tier, as the real engine does"
        )
        out.append(
            f"{g.name} has {g.describe_layers()}: the engine keeps every layer's blocks in "
            f"one pool ({why}), so the pool holds fewer trajectories than `kvpilot plan` counts"
        )
    if len(windows) > 1:
        out.append(
            f"{g.name}'s window layers have {len(windows)} windows: one window pool keeps "
            f"each at the largest ({windows[-1]:,} tokens)"
        )
    if any(group.kind == STATE for group in g.groups):
        out.append(
            f"{g.name}'s linear-attention state is not paged: the simulated pools leave it out"
        )
    return tuple(out)
