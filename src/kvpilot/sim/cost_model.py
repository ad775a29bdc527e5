"""What one engine iteration costs: a roofline of the hardware preset, or a measured profile.

The simulator's executor turns each scheduled batch into a `BatchShape` and asks a
`StepCostModel` how long it takes. Two implementations:

`RooflineCostModel` (per device of one tensor-parallel group)::

    flops    = 2 * P_active * new_tokens  +  4 * L * d_attn * attention_pairs
    bytes    = weight_bytes / TP  +  m_token / TP * (kv_read_tokens + new_tokens)
    compute  = flops / TP / (peak_flops * mfu)
    memory   = bytes / (hbm_bw * hbm_efficiency)
    step     = max(compute, memory) + step_overhead_s

``attention_pairs`` counts causal (query, key) pairs: a chunk of ``c`` tokens after ``p``
cached ones attends to ``c * p + c * (c + 1) / 2`` pairs, so a monolithic prefill of ``S``
tokens costs ``4 L d S (S + 1) / 2`` attention FLOPs: half the spec's ``4 L d S^2``, which
counts the masked half of the square too. Weights are streamed once per step whatever the
batch (every expert of a mixture-of-experts model: an upper bound at large batch).

`CalibratedCostModel` is a least-squares fit of measured step times (see `calibrate`)::

    step = a + b * prefill_tokens + c * decode_seqs + d * kv_read_tokens + e * attention_pairs
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from kvpilot.engine.executor import SeqWork
from kvpilot.errors import ConfigError
from kvpilot.sizing.geometry import ModelGeometry
from kvpilot.sizing.hardware import Node

PROFILE_KIND = "kvpilot-step-profile"
PROFILE_VERSION = 1
PROFILE_FEATURES: tuple[str, ...] = (
    "const",
    "prefill_tokens",
    "decode_seqs",
    "kv_read_tokens",
    "attention_pairs",
)


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What one step computes, as far as its cost goes.

    A work of one token is a decode (cost-wise a one-token prefill chunk is the same);
    longer works are prefill chunks. ``kv_read_tokens`` is the cached context every work
    attends to (its ``start_pos``); ``new_tokens`` is the KV the step writes.
    """

    num_seqs: int = 0
    prefill_tokens: int = 0
    decode_seqs: int = 0
    kv_read_tokens: int = 0
    attention_pairs: int = 0

    @property
    def new_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    def features(self) -> tuple[float, ...]:
        """The regressors of `CalibratedCostModel`, in `PROFILE_FEATURES` order."""
        return (
            1.0,
            float(self.prefill_tokens),
            float(self.decode_seqs),
            float(self.kv_read_tokens),
            float(self.attention_pairs),
        )


def batch_shape(works: Sequence[SeqWork]) -> BatchShape:
    prefill = decode = kv_read = pairs = 0
    for w in works:  # hot path
        c = len(w.token_ids)
        p = w.start_pos
        if c == 1:
            decode += 1
        else:
            prefill += c
        kv_read += p
        pairs += c * p + c * (c + 1) // 2
    return BatchShape(len(works), prefill, decode, kv_read, pairs)


def shape_of(
    *, prefill_tokens: int = 0, decode_seqs: int = 0, context_tokens: int = 0
) -> BatchShape:
    """A batch of one prefill chunk after ``context_tokens`` cached ones plus ``decode_seqs``
    decodes, each at ``context_tokens`` of context (napkin-math shapes)."""
    c, p = prefill_tokens, context_tokens
    seqs = decode_seqs + (1 if c else 0)
    kv_read = p * seqs
    pairs = (c * p + c * (c + 1) // 2) + decode_seqs * (p + 1)
    return BatchShape(seqs, c, decode_seqs, kv_read, pairs)


@dataclass(frozen=True, slots=True)
class StepCost:
    """The breakdown of one step's time (per device)."""

    linear_flops: float
    attention_flops: float
    compute_s: float
    memory_bytes: float
    memory_s: float
    overhead_s: float

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"


class StepCostModel(Protocol):
    block_size: int

    def step_time_s(self, shape: BatchShape) -> float:
        """Seconds one iteration of this shape takes."""
        ...

    def copy_time_s(self, num_blocks: int) -> float:
        """Seconds a device-internal copy of ``num_blocks`` whole blocks takes."""
        ...

    def prefill_tokens_per_s(self) -> float:
        """Sustained prefill rate (tokens/s), the recompute price of the break-even rule."""
        ...

    def describe(self) -> str: ...


@dataclass(frozen=True, slots=True)
class RooflineCostModel:
    """The roofline of one TP group of ``node`` serving ``geometry`` (see the module docstring).

    ``mfu`` is the achieved fraction of peak FLOP/s, ``hbm_efficiency`` the achieved fraction
    of peak HBM bandwidth; ``step_overhead_s`` is the fixed host cost of one iteration
    (scheduling, kernel launches) that no roofline sees.
    """

    geometry: ModelGeometry
    node: Node
    tp: int | None = None
    mfu: float = 0.5
    hbm_efficiency: float = 0.8
    step_overhead_s: float = 1e-3
    block_size: int = 16
    # Per-step constants, derived once: seconds per linear token, per attention pair, of
    # weight streaming, and per KV token moved.
    _s_per_token: float = field(init=False, repr=False, compare=False)
    _s_per_pair: float = field(init=False, repr=False, compare=False)
    _weights_s: float = field(init=False, repr=False, compare=False)
    _s_per_kv_token: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.mfu <= 1.0:
            raise ConfigError(f"mfu is a fraction in (0, 1], got {self.mfu}")
        if not 0.0 < self.hbm_efficiency <= 1.0:
            raise ConfigError(f"hbm_efficiency is a fraction in (0, 1], got {self.hbm_efficiency}")
        if self.step_overhead_s < 0:
            raise ConfigError("step_overhead_s must not be negative")
        tp = self.tp_degree
        if tp < 1 or tp > self.node.count or self.node.count % tp:
            raise ConfigError(
                f"tensor parallel degree {tp} must divide the {self.node.count} accelerators "
                f"of {self.node.name}"
            )
        self.geometry.kv_heads_per_device(tp)
        g = self.geometry
        flops_s = tp * self._flops_per_s()
        bytes_s = self._bytes_per_s()
        d_attn = g.num_attention_heads * g.head_dim
        object.__setattr__(self, "_s_per_token", 2.0 * g.flops_params / flops_s)
        object.__setattr__(self, "_s_per_pair", 4.0 * g.num_layers * d_attn / flops_s)
        object.__setattr__(self, "_weights_s", g.weight_bytes(tp) / bytes_s)
        object.__setattr__(self, "_s_per_kv_token", g.bytes_per_token(tp) / bytes_s)

    @property
    def tp_degree(self) -> int:
        return self.node.count if self.tp is None else self.tp

    @property
    def replicas(self) -> int:
        return self.node.count // self.tp_degree

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token on one device of the TP group."""
        return self.geometry.bytes_per_token(self.tp_degree)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    def _flops_per_s(self) -> float:
        return self.node.accelerator.peak_flops * self.mfu

    def _bytes_per_s(self) -> float:
        return self.node.accelerator.hbm_bw_bytes_s * self.hbm_efficiency

    def cost(self, shape: BatchShape) -> StepCost:
        g = self.geometry
        tp = self.tp_degree
        linear = 2.0 * g.flops_params * shape.new_tokens
        d_attn = g.num_attention_heads * g.head_dim
        attention = 4.0 * g.num_layers * d_attn * shape.attention_pairs
        compute_s = (linear + attention) / tp / self._flops_per_s()
        nbytes = g.weight_bytes(tp) + self.kv_bytes_per_token * (
            shape.kv_read_tokens + shape.new_tokens
        )
        memory_s = nbytes / self._bytes_per_s()
        overhead = self.step_overhead_s if shape.num_seqs else 0.0
        return StepCost(linear, attention, compute_s, nbytes, memory_s, overhead)

    def step_time_s(self, shape: BatchShape) -> float:
        if not shape.num_seqs:
            return 0.0
        new = shape.prefill_tokens + shape.decode_seqs
        compute = self._s_per_token * new + self._s_per_pair * shape.attention_pairs
        memory = self._weights_s + self._s_per_kv_token * (shape.kv_read_tokens + new)
        return (compute if compute > memory else memory) + self.step_overhead_s

    def copy_time_s(self, num_blocks: int) -> float:
        # A device-internal copy reads and writes every byte once.
        return 2.0 * num_blocks * self.block_bytes / self._bytes_per_s()

    def host_transfer_time_s(self, num_blocks: int) -> float:
        """Blocks over each device's host link (every device moves its own share at once)."""
        return num_blocks * self.block_bytes / self.node.accelerator.host_link_bw_bytes_s

    def prefill_tokens_per_s(self) -> float:
        return self.tp_degree * self._flops_per_s() / (2.0 * self.geometry.flops_params)

    def describe(self) -> str:
        a = self.node.accelerator
        return (
            f"roofline {self.geometry.name} on {self.node.name} (TP={self.tp_degree}): "
            f"{a.peak_flops / 1e12:.0f} TFLOP/s x MFU {self.mfu:.2f}, "
            f"{a.hbm_bw_bytes_s / 1e12:.2f} TB/s x {self.hbm_efficiency:.2f}, "
            f"+{self.step_overhead_s * 1e3:.1f} ms/step"
        )


@dataclass(frozen=True, slots=True)
class StepProfile:
    """A measured per-iteration cost profile (the JSON ``kvpilot calibrate`` writes)."""

    model: str
    device: str
    dtype: str
    block_size: int
    coefficients_s: tuple[float, ...]
    copy_block_s: float
    samples: int
    r2: float
    median_rel_error: float
    features: tuple[str, ...] = PROFILE_FEATURES

    def __post_init__(self) -> None:
        if tuple(self.features) != PROFILE_FEATURES:
            raise ConfigError(
                f"profile features {list(self.features)} are not {list(PROFILE_FEATURES)}; "
                f"recalibrate with this version of kvpilot"
            )
        if len(self.coefficients_s) != len(PROFILE_FEATURES):
            raise ConfigError(
                f"a profile needs {len(PROFILE_FEATURES)} coefficients, "
                f"got {len(self.coefficients_s)}"
            )

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["coefficients_s"] = dict(zip(PROFILE_FEATURES, self.coefficients_s, strict=True))
        data.pop("features")
        return {"kind": PROFILE_KIND, "version": PROFILE_VERSION, **data}

    def save(self, path: Path | str) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: object, source: str = "profile") -> StepProfile:
        if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
            raise ConfigError(f"{source} is not a kvpilot step profile (kind {PROFILE_KIND!r})")
        if data.get("version") != PROFILE_VERSION:
            raise ConfigError(
                f"{source}: profile version {data.get('version')!r}, this kvpilot reads "
                f"version {PROFILE_VERSION}; recalibrate"
            )
        try:
            coeffs = data["coefficients_s"]
            if not isinstance(coeffs, dict):
                raise TypeError("coefficients_s must be an object")
            missing = [f for f in PROFILE_FEATURES if f not in coeffs]
            if missing:
                raise KeyError(f"coefficients_s lacks {missing}")
            return cls(
                model=str(data["model"]),
                device=str(data["device"]),
                dtype=str(data["dtype"]),
                block_size=int(data["block_size"]),
                coefficients_s=tuple(float(coeffs[f]) for f in PROFILE_FEATURES),
                copy_block_s=float(data["copy_block_s"]),
                samples=int(data["samples"]),
                r2=float(data["r2"]),
                median_rel_error=float(data["median_rel_error"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: malformed step profile ({exc})") from exc

    @classmethod
    def load(cls, path: Path | str) -> StepProfile:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read step profile {p}: {exc}") from exc
        return cls.from_json(data, str(p))


@dataclass(frozen=True, slots=True)
class CalibratedCostModel:
    """Step times from a measured `StepProfile` (linear in the `BatchShape` features)."""

    profile: StepProfile

    @property
    def block_size(self) -> int:
        return self.profile.block_size

    def step_time_s(self, shape: BatchShape) -> float:
        if not shape.num_seqs:
            return 0.0
        c = self.profile.coefficients_s
        t = (
            c[0]
            + c[1] * shape.prefill_tokens
            + c[2] * shape.decode_seqs
            + c[3] * shape.kv_read_tokens
            + c[4] * shape.attention_pairs
        )
        return max(t, 0.0)

    def copy_time_s(self, num_blocks: int) -> float:
        return num_blocks * self.profile.copy_block_s

    def prefill_tokens_per_s(self) -> float:
        per_token = self.profile.coefficients_s[1]
        return 1.0 / per_token if per_token > 0 else math.inf

    def describe(self) -> str:
        p = self.profile
        return (
            f"calibrated profile of {p.model} on {p.device} ({p.samples} steps, "
            f"R^2 {p.r2:.3f}, median error {p.median_rel_error:.1%})"
        )
