"""Sizing napkin math: KV pool, concurrency (spec equations 3-7), block sizing, pause pricing.

All capacities are computed per TP group (one model replica) and multiplied by the number of
replicas in the node. Sizes are bytes; a caller mixing GB and GiB (as the spec's examples do)
passes whichever it means.

KV is sized layer by layer (`ModelGeometry.kv_bytes`): a hybrid model's sliding-window layers
hold at most their window per sequence, so equations 6 and 7 divide the pool by what a
trajectory really holds, not by ``context * m_token``. Without ``tp``, the plan takes the
smallest tensor-parallel degree whose weights leave a KV pool that holds one sequence of the
longest planned context, and fills the node with replicas of it. Contexts past the model's
``max_position_embeddings`` are clamped to it, with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.errors import ConfigError
from kvpilot.policy.breakeven import PauseDecision, PauseInputs, decide_pause
from kvpilot.sizing.capacity import (
    DEFAULT_RESERVE_BYTES_PER_DEVICE,
    BlockRow,
    MemoryBudget,
    block_sizing,
    default_tp,
    memory_budget,
    trajectory_concurrency,
)
from kvpilot.sizing.geometry import ModelGeometry
from kvpilot.sizing.hardware import Node
from kvpilot.sizing.pool_split import HybridPoolRow, hybrid_pool_rows

DEFAULT_CONTEXTS: tuple[int, ...] = (8192, 32768, 131072)
DEFAULT_SHARED_TOKENS = 24576
DEFAULT_BLOCK_SIZES: tuple[int, ...] = (16,)
DEFAULT_NUM_SEQS = 256
DEFAULT_MFU = 0.45
DEFAULT_STEP_TOKENS = 2048  # the engine's and simulator's default token budget per step


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


@dataclass(frozen=True, slots=True)
class TokenFootprint:
    """KV bytes per token: whole model (tp=1), on one device, and across one TP group.

    ``model_bytes`` is equation 1 over every attention layer. A hybrid model splits it:
    ``full_model_bytes`` per token in the full-attention layers (growing with the context),
    and at most ``window_cap_model_bytes`` per sequence in its window layers, plus a fixed
    ``state_model_bytes`` per sequence in linear-attention layers (all for the whole model).
    """

    model_bytes: int
    device_bytes: int
    group_bytes: int
    full_model_bytes: int
    window_cap_model_bytes: int
    state_model_bytes: int


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
class PauseRow:
    context_tokens: int
    kv_bytes: int
    decision: PauseDecision


@dataclass(frozen=True, slots=True)
class Plan:
    """A plan. ``tp_reason`` says how the TP degree was chosen; ``warnings`` what was changed
    or assumed that a user should know (clamped contexts, fp32 KV)."""

    model: str
    node: str
    kv_dtype: str
    weight_dtype: str
    layers: str
    max_context_tokens: int | None
    tp_reason: str
    warnings: tuple[str, ...]
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
    pools: tuple[HybridPoolRow, ...] = ()  # hybrid models: the main and window pools


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
        kv_bytes=geometry.kv_bytes(context_tokens, tp) * tp,
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


def planned_contexts(config: PlanConfig) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The contexts to plan, clamped so that context + output fits the model's limit."""
    limit = config.geometry.max_context_tokens
    if limit is None:
        return config.contexts, ()
    room = limit - config.output_tokens
    name = config.geometry.name
    if room <= 0:
        raise ConfigError(
            f"--output {config.output_tokens:,} leaves no context within {name}'s limit of "
            f"{limit:,} tokens (max_position_embeddings)"
        )
    over = [c for c in config.contexts if c > room]
    if not over:
        return config.contexts, ()
    clamped = tuple(dict.fromkeys(min(c, room) for c in config.contexts))
    listed = ", ".join(f"{c:,}" for c in over)
    plural = "s" if len(over) > 1 else ""
    output = f" + {config.output_tokens:,} of output" if config.output_tokens else ""
    return clamped, (
        f"context{plural} {listed} exceed{'' if plural else 's'} {name}'s limit of {limit:,} "
        f"tokens (max_position_embeddings): planned at {room:,} tokens{output}",
    )


def dtype_warnings(geometry: ModelGeometry) -> tuple[str, ...]:
    out = []
    if geometry.kv_dtype == "fp32":
        out.append(
            "KV cache in fp32 (4 bytes per element, twice bf16), as the model's dtype says; "
            "engines usually serve in bf16: pass --kv-dtype bf16 to plan that"
        )
    if geometry.weight_dtype == "fp32":
        out.append(
            "weights in fp32 (4 bytes per parameter); pass --weights-dtype bf16 to plan a "
            "bf16 deployment"
        )
    return tuple(out)


def make_plan(config: PlanConfig) -> Plan:
    geometry, node = config.geometry, config.node
    contexts, warnings = planned_contexts(config)
    longest = max(contexts) + config.output_tokens
    if config.tp is None:
        tp, why = default_tp(
            geometry, node, longest, config.reserve_bytes_per_device, config.weight_bytes
        )
        tp_reason = f"TP {tp}: {why}"
    else:
        tp, tp_reason = config.tp, f"TP {config.tp}: given"
    budget = memory_budget(geometry, node, tp, config.reserve_bytes_per_device, config.weight_bytes)
    window_cap = sum(
        g.num_layers * (g.window_tokens or 0) for g in geometry.window_groups
    ) * geometry.layer_bytes_per_token(1)
    footprint = TokenFootprint(
        model_bytes=geometry.bytes_per_token(1),
        device_bytes=geometry.bytes_per_token(tp),
        group_bytes=geometry.group_bytes_per_token(tp),
        full_model_bytes=geometry.full_bytes_per_token(1),
        window_cap_model_bytes=window_cap,
        state_model_bytes=geometry.state_bytes_per_seq(1),
    )
    group_pool = budget.pool_bytes_per_device * tp

    def capacity(context: int, shared: int) -> int | None:
        per_group = trajectory_concurrency(
            geometry, group_pool, tp, context, config.output_tokens, shared, config.headroom
        )
        return None if per_group is None else per_group * budget.replicas

    rows = []
    for context in contexts:
        cold = capacity(context, 0)
        assert cold is not None
        rows.append(
            CapacityRow(
                context_tokens=context,
                trajectory_bytes=geometry.kv_bytes(context, tp) * tp,
                cold=cold,
                shared=capacity(context, config.shared_tokens),
            )
        )
    blocks = tuple(
        block_sizing(budget.pool_bytes_per_device, footprint.device_bytes, b, config.num_seqs)
        for b in config.block_sizes
    )
    pools = hybrid_pool_rows(
        geometry,
        budget.pool_bytes_per_device,
        tp,
        config.block_sizes,
        max_num_seqs=config.num_seqs,
        max_num_batched_tokens=DEFAULT_STEP_TOKENS,
        longest_tokens=longest,
    )
    pauses: tuple[PauseRow, ...] = ()
    if config.pause_s is not None:
        pauses = tuple(
            PauseRow(
                context_tokens=context,
                kv_bytes=geometry.kv_bytes(context, tp) * tp,
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
            for context in contexts
        )
    return Plan(
        model=geometry.name,
        node=node.name,
        kv_dtype=geometry.kv_dtype,
        weight_dtype=geometry.weight_dtype,
        layers=geometry.describe_layers(),
        max_context_tokens=geometry.max_context_tokens,
        tp_reason=tp_reason,
        warnings=warnings + dtype_warnings(geometry),
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
        pools=pools,
    )
