"""Memory budget and concurrency: what a TP group's KV pool holds (spec equations 3-7).

Sizes are bytes. `memory_budget` is equations 3-5 (HBM = weights + reserve + pool);
`concurrency` is equations 6 and 7 for any split of a trajectory's KV into bytes held once
(a shared prefix) and bytes held alone; `trajectory_concurrency` feeds it a model's
layer-by-layer sizes; `default_tp` picks the tensor-parallel degree a plan uses unless told.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.errors import ConfigError
from kvpilot.sizing.geometry import ModelGeometry
from kvpilot.sizing.hardware import Node
from kvpilot.units import format_bytes

DEFAULT_RESERVE_BYTES_PER_DEVICE = 2.5e9


def _floor(x: float) -> int:
    """floor() that does not lose a whole unit to float rounding (35.99999999 -> 36)."""
    return math.floor(x * (1 + 1e-12))


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """Spec equations 3-5: device memory = weights + reserve + KV pool."""

    devices: int
    tp: int
    replicas: int
    hbm_bytes_per_device: int
    weight_bytes_per_device: float
    reserve_bytes_per_device: float
    pool_bytes_per_device: float
    hbm_bytes_node: int
    weight_bytes_node: float
    reserve_bytes_node: float
    pool_bytes_node: float


@dataclass(frozen=True, slots=True)
class BlockRow:
    """Paged pool of one device at one block size, and its expected tail waste."""

    block_size: int
    block_bytes: int
    num_blocks: int
    token_capacity: int
    tail_waste_tokens_per_seq: float
    tail_waste_bytes: float
    tail_waste_fraction: float


def memory_budget(
    geometry: ModelGeometry,
    node: Node,
    tp: int,
    reserve_bytes_per_device: float = DEFAULT_RESERVE_BYTES_PER_DEVICE,
    weight_bytes: float | None = None,
) -> MemoryBudget:
    """The KV pool left on each device once weights (one copy per TP group) and reserve are out."""
    if tp <= 0 or tp > node.count or node.count % tp:
        raise ConfigError(
            f"tensor parallel degree {tp} must divide the {node.count} accelerators of "
            f"{node.name} (multi-node TP is not modelled)"
        )
    geometry.kv_heads_per_device(tp)
    weights = (weight_bytes if weight_bytes is not None else geometry.weight_bytes(1)) / tp
    hbm = node.accelerator.hbm_bytes
    pool = hbm - weights - reserve_bytes_per_device
    if pool <= 0:
        raise ConfigError(
            f"{geometry.name} leaves no KV pool on {node.accelerator.name} at TP {tp}: "
            f"{format_bytes(weights)} of {geometry.weight_dtype} weights and "
            f"{format_bytes(reserve_bytes_per_device)} of reserve per device exceed its "
            f"{format_bytes(hbm)}; raise --tp, lower --weights-dtype or use a bigger --node"
        )
    n = node.count
    return MemoryBudget(
        devices=n,
        tp=tp,
        replicas=n // tp,
        hbm_bytes_per_device=hbm,
        weight_bytes_per_device=weights,
        reserve_bytes_per_device=reserve_bytes_per_device,
        pool_bytes_per_device=pool,
        hbm_bytes_node=n * hbm,
        weight_bytes_node=n * weights,
        reserve_bytes_node=n * reserve_bytes_per_device,
        pool_bytes_node=n * pool,
    )


def max_concurrency(
    pool_bytes: float,
    bytes_per_token: float,
    context_tokens: int,
    output_tokens: int = 0,
    shared_tokens: int = 0,
    headroom: float = 0.0,
) -> int | None:
    """Trajectories a KV pool holds at a uniform ``bytes_per_token`` (spec eq. 6; eq. 7 when
    `shared_tokens` > 0).

    The shared prefix is part of each context, held once; each trajectory privately holds
    the rest of its context plus its output. The pool keeps `headroom` of itself free.
    None when the shared prefix is longer than the context, or is all of a trajectory
    with no output (no private state, so no KV limit).
    """
    private = context_tokens - shared_tokens + output_tokens
    if shared_tokens > context_tokens or private == 0:
        return None
    return concurrency(
        pool_bytes, shared_tokens * bytes_per_token, private * bytes_per_token, headroom
    )


def concurrency(
    pool_bytes: float, shared_bytes: float, private_bytes: float, headroom: float = 0.0
) -> int:
    """Trajectories that fit when ``shared_bytes`` are held once and each trajectory holds
    ``private_bytes`` alone, keeping ``headroom`` of the pool free (equations 6 and 7)."""
    if private_bytes <= 0:
        raise ValueError("every trajectory holds some private KV")
    usable = pool_bytes * (1.0 - headroom) - shared_bytes
    return max(0, _floor(usable / private_bytes))


def trajectory_concurrency(
    geometry: ModelGeometry,
    pool_bytes: float,
    tp: int,
    context_tokens: int,
    output_tokens: int = 0,
    shared_tokens: int = 0,
    headroom: float = 0.0,
) -> int | None:
    """Trajectories one TP group's pool (``pool_bytes`` across its devices) holds, sized
    layer by layer; None as in `max_concurrency`."""
    total = context_tokens + output_tokens
    if shared_tokens > context_tokens or total == shared_tokens:
        return None
    shared, private = geometry.shared_and_private_bytes(total, shared_tokens, tp)
    return concurrency(pool_bytes, shared * tp, private * tp, headroom)


def default_tp(
    geometry: ModelGeometry,
    node: Node,
    longest_tokens: int,
    reserve_bytes_per_device: float = DEFAULT_RESERVE_BYTES_PER_DEVICE,
    weight_bytes: float | None = None,
) -> tuple[int, str]:
    """The smallest TP degree whose weights leave a pool holding one ``longest_tokens``-token
    sequence (the rest of the node runs replicas of it), and why it was chosen.

    Smaller groups keep fewer weight copies per replica but never split KV heads across more
    devices than needed: a 7B model with 4 KV heads gets TP 1 and 8 replicas on 8 GPUs, not
    TP 8 with its heads replicated twice. Falls back to the smallest degree with any pool.
    """
    degrees = [
        tp
        for tp in range(1, node.count + 1)
        if node.count % tp == 0
        and (geometry.num_kv_heads % tp == 0 or tp % geometry.num_kv_heads == 0)
    ]
    any_pool = None
    for tp in degrees:
        try:
            budget = memory_budget(geometry, node, tp, reserve_bytes_per_device, weight_bytes)
        except ConfigError:
            continue
        if budget.pool_bytes_per_device >= geometry.kv_bytes(longest_tokens, tp):
            return tp, (
                f"the smallest whose weights leave room for a {longest_tokens:,}-token sequence"
            )
        any_pool = any_pool or tp
    if any_pool is not None:
        return any_pool, (
            f"the smallest with a KV pool; no degree holds a {longest_tokens:,}-token sequence"
        )
    # No degree leaves a pool: let the largest one explain what is missing.
    memory_budget(geometry, node, degrees[-1], reserve_bytes_per_device, weight_bytes)
    raise AssertionError("unreachable: memory_budget raises when no pool is left")


def block_sizing(
    pool_bytes: float, bytes_per_token: int, block_size: int, num_seqs: int
) -> BlockRow:
    """Blocks of `block_size` tokens in a pool, and the (B-1)/2 expected tail waste per sequence."""
    block_bytes = block_size * bytes_per_token
    num_blocks = _floor(pool_bytes / block_bytes)
    waste_tokens = (block_size - 1) / 2
    waste_bytes = num_seqs * waste_tokens * bytes_per_token
    return BlockRow(
        block_size=block_size,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        token_capacity=num_blocks * block_size,
        tail_waste_tokens_per_seq=waste_tokens,
        tail_waste_bytes=waste_bytes,
        tail_waste_fraction=waste_bytes / pool_bytes,
    )
