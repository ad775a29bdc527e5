"""One device's KV memory split between a hybrid model's two block pools.

An engine with per-layer-group block tables (`kvpilot.memory.window`) keeps the
full-attention layers' KV in the main pool and the sliding-window layers' KV in a window
pool, both in blocks of ``B`` tokens. A sequence of ``S`` tokens holds ``ceil(S/B)`` main
blocks (what `kvpilot plan` counts per token for the full layers) and at most
``ceil(W/B) + 1`` window blocks, plus the block it is growing into (the plan's per-sequence
cap for window layers, in blocks)::

    window pool = n * (ceil(W/B) + 2) + ceil(max_num_batched_tokens / B) + 1 (null block)
    main pool   = (pool bytes - window pool * window block bytes) // main block bytes

where ``n`` is how many sequences run at once: ``max_num_seqs``, but never more than the
pool holds sequences of the longest context ``L`` layer by layer (so the main pool keeps
room for as many ``L``-token sequences as the window pool has windows: the plan's capacity
at ``L``). A model with no full-attention layer spends nothing on main blocks: it gets
enough of them for every window of the pool at ``L`` tokens.

The real engine (`kvpilot.model.window_group.split_kv_budget`) and the simulator
(`kvpilot.sim.build`) both size their pools with `split_pool`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.errors import ConfigError
from kvpilot.sizing.geometry import ModelGeometry
from kvpilot.sizing.layers import FULL, WINDOW


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class PoolSplit:
    """A KV memory budget split between the two groups' pools (blocks of each)."""

    main_blocks: int
    window_blocks: int  # the null block included


def window_blocks_per_seq(window_tokens: int, block_size: int) -> int:
    """Window blocks one running sequence needs at most: ceil(W/B) + 1 of computed KV, and
    the block it grows into."""
    return _ceil_div(window_tokens, block_size) + 2


def split_pool(
    pool_bytes: float,
    main_block_bytes: int,
    window_block_bytes: int,
    *,
    window_tokens: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    longest_tokens: int,
) -> PoolSplit:
    """The split of the module docstring; a ConfigError when no block fits."""
    if window_block_bytes <= 0 or window_tokens < 1 or block_size < 1:
        raise ConfigError("a window pool needs window layers, a window and a block size")
    whole = main_block_bytes + window_block_bytes
    today = int(pool_bytes // whole)  # blocks if every layer kept every block
    if today < 1:
        raise ConfigError(
            f"KV memory of {pool_bytes:,.0f} bytes holds no block of {whole} bytes "
            f"(block_size {block_size}); give more memory or a smaller block size"
        )
    per_seq = window_blocks_per_seq(window_tokens, block_size)
    longest = _ceil_div(longest_tokens, block_size)
    longest_seq_bytes = longest * main_block_bytes + min(per_seq, longest + 1) * window_block_bytes
    seqs = max(1, min(max_num_seqs, int(pool_bytes // longest_seq_bytes)))
    wanted = seqs * per_seq + _ceil_div(max_num_batched_tokens, block_size)
    window = min(wanted, today) + 1
    if main_block_bytes == 0:
        return PoolSplit(max(today, (window // per_seq) * longest), window)
    main = int((pool_bytes - window * window_block_bytes) // main_block_bytes)
    if main < 1:
        raise ConfigError(
            f"KV memory of {pool_bytes:,.0f} bytes leaves no full-attention block after the "
            f"sliding-window pool ({window} blocks); give more memory or lower max_num_seqs"
        )
    return PoolSplit(main, window)


@dataclass(frozen=True, slots=True)
class HybridBlocks:
    """A hybrid geometry's two block sizes on one device of a TP group, and its window."""

    main_block_bytes: int
    window_block_bytes: int
    window_tokens: int


def hybrid_blocks(geometry: ModelGeometry, tp: int, block_size: int) -> HybridBlocks | None:
    """Bytes of one block in each pool, by the plan's per-layer arithmetic (None: no window
    layers). Window layers of several windows share one pool at the largest window;
    linear-attention state is not paged (it is not counted in either pool)."""
    windows = geometry.window_groups
    if not windows:
        return None
    per_layer = geometry.layer_bytes_per_token(tp) * block_size
    full_layers = sum(g.num_layers for g in geometry.groups if g.kind == FULL)
    window_layers = sum(g.num_layers for g in geometry.groups if g.kind == WINDOW)
    return HybridBlocks(
        main_block_bytes=full_layers * per_layer,
        window_block_bytes=window_layers * per_layer,
        window_tokens=max(g.window_tokens or 0 for g in windows),
    )


@dataclass(frozen=True, slots=True)
class HybridPoolRow:
    """One device's pools at one block size, as the engine and the simulator split them, and
    how many sequences of ``longest_tokens`` they hold at once (each pool's blocks over what
    one such sequence holds there)."""

    block_size: int
    main_blocks: int
    main_block_bytes: int
    window_blocks: int  # the null block included
    window_block_bytes: int
    longest_tokens: int
    longest_seqs: int


def hybrid_pool_rows(
    geometry: ModelGeometry,
    pool_bytes: float,
    tp: int,
    block_sizes: tuple[int, ...],
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    longest_tokens: int,
) -> tuple[HybridPoolRow, ...]:
    """`split_pool` at each block size (none for a model without window layers)."""
    rows = []
    for bs in block_sizes:
        blocks = hybrid_blocks(geometry, tp, bs)
        if blocks is None:
            return ()
        split = split_pool(
            pool_bytes,
            blocks.main_block_bytes,
            blocks.window_block_bytes,
            window_tokens=blocks.window_tokens,
            block_size=bs,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            longest_tokens=longest_tokens,
        )
        longest = _ceil_div(longest_tokens, bs)
        per_seq = min(window_blocks_per_seq(blocks.window_tokens, bs), longest + 1)
        seqs = (split.window_blocks - 1) // per_seq
        if blocks.main_block_bytes:
            seqs = min(seqs, split.main_blocks // longest)
        rows.append(
            HybridPoolRow(
                block_size=bs,
                main_blocks=split.main_blocks,
                main_block_bytes=blocks.main_block_bytes,
                window_blocks=split.window_blocks,
                window_block_bytes=blocks.window_block_bytes,
                longest_tokens=longest_tokens,
                longest_seqs=max(0, seqs),
            )
        )
    return tuple(rows)
