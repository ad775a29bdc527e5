"""Sizing napkin math: KV pool, concurrency (spec equations 3-7), block sizing, pause pricing.

All capacities are computed per TP group (one model replica) and multiplied by the number of
replicas in the node. Sizes are bytes; a caller mixing GB and GiB (as the spec's examples do)
passes whichever it means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.errors import ConfigError
from kvpilot.policy.breakeven import PauseDecision, PauseInputs, decide_pause
from kvpilot.sizing.geometry import ModelGeometry
from kvpilot.sizing.hardware import Node

DEFAULT_CONTEXTS: tuple[int, ...] = (8192, 32768, 131072)
DEFAULT_SHARED_TOKENS = 24576
DEFAULT_RESERVE_BYTES_PER_DEVICE = 2.5e9
DEFAULT_BLOCK_SIZES: tuple[int, ...] = (16,)
DEFAULT_NUM_SEQS = 256
DEFAULT_MFU = 0.45


def _floor(x: float) -> int:
    """floor() that does not lose a whole unit to float rounding (35.99999999 -> 36)."""
    return math.floor(x * (1 + 1e-12))


@dataclass(frozen=True, slots=True)
class PlanConfig:
    """Everything `make_plan` needs; defaults reproduce the spec's Napkin Math 0.1 node.

    `reserve_bytes_per_device` is the runtime reserve (activations, CUDA context, NCCL buffers)
    on each device; `weight_bytes` overrides the weights of one model copy, split across TP.
    `shared_tokens` is a prefix common to all trajectories, counted inside each context.
    The pause decision prices memory with `device_pressure` (1: work is waiting for device
    memory) and `host_pressure` (0: host memory is free).
    """

    geometry: ModelGeometry
    node: Node
    tp: int | None = None
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    shared_tokens: int = DEFAULT_SHARED_TOKENS
    output_tokens: int = 0
    headroom: float = 0.0
    reserve_bytes_per_device: float = DEFAULT_RESERVE_BYTES_PER_DEVICE
    weight_bytes: float | None = None
    block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES
    num_seqs: int = DEFAULT_NUM_SEQS
    pause_s: float | None = None
    mfu: float = DEFAULT_MFU
    device_pressure: float = 1.0
    host_pressure: float = 0.0

    def __post_init__(self) -> None:
        if not self.contexts or any(c <= 0 for c in self.contexts):
            raise ConfigError("every --context must be a positive number of tokens")
        if self.shared_tokens < 0 or self.output_tokens < 0:
            raise ConfigError("--shared and --output must not be negative")
        if not 0.0 <= self.headroom < 1.0:
            raise ConfigError(f"--headroom is a fraction in [0, 1), got {self.headroom}")
        if self.reserve_bytes_per_device < 0:
            raise ConfigError("--reserve must not be negative")
        if self.weight_bytes is not None and self.weight_bytes < 0:
            raise ConfigError("--weights must not be negative")
        if not self.block_sizes or any(b <= 0 for b in self.block_sizes):
            raise ConfigError("every --block-size must be a positive number of tokens")
        if self.num_seqs < 0:
            raise ConfigError("--seqs must not be negative")
        if self.pause_s is not None and self.pause_s < 0:
            raise ConfigError("--pause must not be negative")
        if not 0.0 < self.mfu <= 1.0:
            raise ConfigError(f"--mfu is a fraction in (0, 1], got {self.mfu}")

    @property
    def tp_degree(self) -> int:
        return self.node.count if self.tp is None else self.tp


@dataclass(frozen=True, slots=True)
class TokenFootprint:
    """KV bytes per token: whole model (tp=1), on one device, and across one TP group."""

    model_bytes: int
    device_bytes: int
    group_bytes: int


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
class CapacityRow:
    """Trajectories a node holds at one context length: cold (eq. 6) and sharing a prefix (eq. 7).

    `shared` is None when the shared prefix is longer than the context itself (or is the
    whole trajectory).
    """

    context_tokens: int
    trajectory_bytes: int
    cold: int
    shared: int | None


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


@dataclass(frozen=True, slots=True)
class PauseRow:
    context_tokens: int
    kv_bytes: int
    decision: PauseDecision


@dataclass(frozen=True, slots=True)
class Plan:
    model: str
    node: str
    kv_dtype: str
    weight_dtype: str
    shared_tokens: int
    output_tokens: int
    headroom: float
    num_seqs: int
    pause_s: float | None
    footprint: TokenFootprint
    budget: MemoryBudget
    capacity: tuple[CapacityRow, ...]
    blocks: tuple[BlockRow, ...]
    pauses: tuple[PauseRow, ...]


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
            f"{geometry.name} leaves no KV pool on {node.accelerator.name}: "
            f"{weights / 1e9:.1f} GB of weights and {reserve_bytes_per_device / 1e9:.1f} GB of "
            f"reserve per device exceed its {hbm / 1e9:.1f} GB; raise --tp or use a bigger --node"
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
    """Trajectories a KV pool holds (spec eq. 6; eq. 7 when `shared_tokens` > 0).

    The shared prefix is part of each context, held once; each trajectory privately holds
    the rest of its context plus its output. The pool keeps `headroom` of itself free.
    None when the shared prefix is longer than the context, or is all of a trajectory
    with no output (no private state, so no KV limit).
    """
    private = context_tokens - shared_tokens + output_tokens
    if shared_tokens > context_tokens or private == 0:
        return None
    usable = pool_bytes * (1.0 - headroom) - shared_tokens * bytes_per_token
    return max(0, _floor(usable / (private * bytes_per_token)))


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


def pause_inputs(
    geometry: ModelGeometry,
    node: Node,
    tp: int,
    context_tokens: int,
    wait_s: float,
    mfu: float = DEFAULT_MFU,
    device_pressure: float = 1.0,
    host_pressure: float = 0.0,
) -> PauseInputs:
    """Break-even inputs for one trajectory on a TP group: its links, FLOPs and host share."""
    accel = node.accelerator
    return PauseInputs(
        kv_bytes=context_tokens * geometry.group_bytes_per_token(tp),
        num_tokens=context_tokens,
        expected_wait_s=wait_s,
        device_host_bw_bytes_s=tp * accel.host_link_bw_bytes_s,
        host_disk_bw_bytes_s=node.nvme_bw_bytes_s,
        num_params=geometry.flops_params,
        prefill_flops_per_s=mfu * tp * accel.peak_flops,
        device_pressure=device_pressure,
        host_pressure=host_pressure,
        host_free_bytes=tp * accel.host_mem_bytes,
    )


def make_plan(config: PlanConfig) -> Plan:
    geometry, node, tp = config.geometry, config.node, config.tp_degree
    budget = memory_budget(geometry, node, tp, config.reserve_bytes_per_device, config.weight_bytes)
    footprint = TokenFootprint(
        model_bytes=geometry.bytes_per_token(1),
        device_bytes=geometry.bytes_per_token(tp),
        group_bytes=geometry.group_bytes_per_token(tp),
    )
    group_pool = budget.pool_bytes_per_device * tp

    def capacity(context: int, shared: int) -> int | None:
        per_group = max_concurrency(
            group_pool,
            footprint.group_bytes,
            context,
            config.output_tokens,
            shared,
            config.headroom,
        )
        return None if per_group is None else per_group * budget.replicas

    rows = []
    for context in config.contexts:
        cold = capacity(context, 0)
        assert cold is not None
        rows.append(
            CapacityRow(
                context_tokens=context,
                trajectory_bytes=context * footprint.group_bytes,
                cold=cold,
                shared=capacity(context, config.shared_tokens),
            )
        )
    blocks = tuple(
        block_sizing(budget.pool_bytes_per_device, footprint.device_bytes, b, config.num_seqs)
        for b in config.block_sizes
    )
    pauses: tuple[PauseRow, ...] = ()
    if config.pause_s is not None:
        pauses = tuple(
            PauseRow(
                context_tokens=context,
                kv_bytes=context * footprint.group_bytes,
                decision=decide_pause(
                    pause_inputs(
                        geometry,
                        node,
                        tp,
                        context,
                        config.pause_s,
                        config.mfu,
                        config.device_pressure,
                        config.host_pressure,
                    )
                ),
            )
            for context in config.contexts
        )
    return Plan(
        model=geometry.name,
        node=node.name,
        kv_dtype=geometry.kv_dtype,
        weight_dtype=geometry.weight_dtype,
        shared_tokens=config.shared_tokens,
        output_tokens=config.output_tokens,
        headroom=config.headroom,
        num_seqs=config.num_seqs,
        pause_s=config.pause_s,
        footprint=footprint,
        budget=budget,
        capacity=tuple(rows),
        blocks=blocks,
        pauses=pauses,
    )
