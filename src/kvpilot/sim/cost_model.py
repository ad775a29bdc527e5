"""What one engine iteration costs: a roofline of the hardware preset, or a measured profile.

The simulator's executor turns each scheduled batch into a `BatchShape` and asks a
`StepCostModel` how long it takes. Two implementations: `RooflineCostModel` (here) and
`kvpilot.sim.profile.CalibratedCostModel` (a least-squares fit of measured step times).

`RooflineCostModel` (per device of one tensor-parallel group), layer by layer::

    flops    = 2 * P_active * new_tokens  +  4 * d_attn * (L_full * attention_pairs
                                                         + sum_g L_g * window_pairs_g)
    bytes    = weight_bytes / TP  +  m_layer / TP * (L_full * (kv_read_tokens + new_tokens)
                                              + sum_g L_g * (window_kv_read_g + new_tokens))
    compute  = flops / TP / (peak_flops * mfu)
    memory   = bytes / (hbm_bw * hbm_efficiency)
    step     = max(compute, memory) + step_overhead_s

``attention_pairs`` counts causal (query, key) pairs: a chunk of ``c`` tokens after ``p``
cached ones attends to ``c * p + c * (c + 1) / 2`` pairs, so a monolithic prefill of ``S``
tokens costs ``4 L d S (S + 1) / 2`` attention FLOPs: half the spec's ``4 L d S^2``, which
counts the masked half of the square too. A sliding-window layer group ``g`` of window
``W`` reads at most ``W`` cached tokens and each query attends to at most ``W`` keys
(``window_kv_read``, ``window_pairs``). Weights are streamed once per step whatever the
batch (every expert of a mixture-of-experts model: an upper bound at large batch).

``shared_kv_tokens`` is the KV a step reads more than once (several sequences reading one
cached prefix: agent sessions sharing a system prompt); the roofline charges every read, but
a measured profile may read shared KV faster (`CalibratedCostModel`). A cost model that reads
it says so (``reads_distinct_kv``): only then does the simulated runner count it.

`decode_run_s` gives the durations of successive decode-only steps (the simulator's uniform
decode runs), equal bit for bit to `step_time_s` of each step's shape; `decode_run_clock`
the same durations with the clock times they lead to, as far as a run may go.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

from kvpilot.errors import ConfigError
from kvpilot.sim.batch_shape import BatchShape
from kvpilot.sizing.geometry import ModelGeometry
from kvpilot.sizing.hardware import Node


def run_clock(
    durations: Iterator[float], start: float, until: float, max_steps: int
) -> tuple[list[float], list[float]]:
    """Successive step ``durations`` from clock time ``start``: the first ones, up to
    ``max_steps`` of them or to the first that ends at or after ``until``, and the start
    times of those steps followed by the last one's end. Each time is the previous one plus
    its step's duration, the addition a clock advanced step by step makes::

        durations:   d_0      d_1            d_{k-1}
        starts:   s_0 ---> s_1 ---> ... ---> s_{k-1} ---> s_k     s_{j+1} = s_j + d_j
    """
    taken: list[float] = []
    starts = [start]
    t = start
    for dt in islice(durations, max_steps):
        t += dt
        taken.append(dt)
        starts.append(t)
        if t >= until:
            break
    return taken, starts


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
    @property
    def block_size(self) -> int: ...

    @property
    def windows(self) -> tuple[int, ...]:
        """Sliding windows (tokens) whose capped figures `BatchShape` must carry."""
        ...

    @property
    def reads_distinct_kv(self) -> bool:
        """Whether `step_time_s` reads ``shared_kv_tokens`` (the runner counts it only then),
        and `decode_run_clock` its ``shared_kv_tokens``."""
        ...

    def step_time_s(self, shape: BatchShape) -> float:
        """Seconds one iteration of this shape takes."""
        ...

    def decode_run_s(self, positions: Sequence[int]) -> Iterator[float]:
        """Seconds of each successive decode-only iteration of sequences at ``positions``
        (each one token further per step): `step_time_s` of each step's shape, exactly."""
        ...

    def decode_run_clock(
        self,
        positions: Sequence[int],
        start: float,
        until: float,
        max_steps: int,
        shared_kv_tokens: int = 0,
    ) -> tuple[list[float], list[float]]:
        """`run_clock` of `decode_run_s`: the durations of the run's steps from clock time
        ``start`` and their start times. ``shared_kv_tokens``: the KV the run's steps read
        more than once (the same at every step; only given when ``reads_distinct_kv``)."""
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
    # Per-step constants, derived once: seconds per linear token, per attention pair of the
    # full layers, of weight streaming, per KV token of the full layers moved, and the same
    # pair and KV figures for each window group.
    _s_per_token: float = field(init=False, repr=False, compare=False)
    _s_per_pair: float = field(init=False, repr=False, compare=False)
    _weights_s: float = field(init=False, repr=False, compare=False)
    _s_per_kv_token: float = field(init=False, repr=False, compare=False)
    _windows: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _s_per_window_pair: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _s_per_window_kv: tuple[float, ...] = field(init=False, repr=False, compare=False)

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
        g = self.geometry
        flops_s = tp * self._flops_per_s()
        bytes_s = self._bytes_per_s()
        d_attn = g.num_attention_heads * g.head_dim
        layer_bytes = g.layer_bytes_per_token(tp)
        groups: dict[int, int] = {}
        for group in g.window_groups:
            assert group.window_tokens is not None
            groups[group.window_tokens] = groups.get(group.window_tokens, 0) + group.num_layers
        windows = tuple(sorted(groups))
        set_ = object.__setattr__
        set_(self, "_s_per_token", 2.0 * g.flops_params / flops_s)
        set_(self, "_s_per_pair", 4.0 * g.num_full_layers * d_attn / flops_s)
        set_(self, "_weights_s", g.weight_bytes(tp) / bytes_s)
        set_(self, "_s_per_kv_token", g.num_full_layers * layer_bytes / bytes_s)
        set_(self, "_windows", windows)
        set_(self, "_s_per_window_pair", tuple(4.0 * groups[w] * d_attn / flops_s for w in windows))
        set_(self, "_s_per_window_kv", tuple(groups[w] * layer_bytes / bytes_s for w in windows))

    @property
    def tp_degree(self) -> int:
        return self.node.count if self.tp is None else self.tp

    @property
    def replicas(self) -> int:
        return self.node.count // self.tp_degree

    @property
    def windows(self) -> tuple[int, ...]:
        return self._windows

    @property
    def reads_distinct_kv(self) -> bool:
        return False  # HBM streams every read, shared or not

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token in every attention layer, on one device of the TP group:
        what one slot of the engine's blocks holds (its blocks span every layer)."""
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
        attention = 4.0 * g.num_full_layers * d_attn * shape.attention_pairs
        layer_bytes = g.layer_bytes_per_token(tp)
        nbytes = g.weight_bytes(tp) + g.num_full_layers * layer_bytes * (
            shape.kv_read_tokens + shape.new_tokens
        )
        for group in g.window_groups:
            i = self._windows.index(group.window_tokens or 0)
            attention += 4.0 * group.num_layers * d_attn * shape.window_pairs[i]
            nbytes += group.num_layers * layer_bytes * (shape.window_kv_read[i] + shape.new_tokens)
        compute_s = (linear + attention) / tp / self._flops_per_s()
        memory_s = nbytes / self._bytes_per_s()
        overhead = self.step_overhead_s if shape.num_seqs else 0.0
        return StepCost(linear, attention, compute_s, nbytes, memory_s, overhead)

    def step_time_s(self, shape: BatchShape) -> float:
        if not shape.num_seqs:
            return 0.0
        new = shape.prefill_tokens + shape.decode_seqs
        compute = self._s_per_token * new + self._s_per_pair * shape.attention_pairs
        memory = self._weights_s + self._s_per_kv_token * (shape.kv_read_tokens + new)
        if self._windows:  # no enumerate built per step for a model without windows
            for i, s_pair in enumerate(self._s_per_window_pair):
                compute += s_pair * shape.window_pairs[i]
                memory += self._s_per_window_kv[i] * (shape.window_kv_read[i] + new)
        return (compute if compute > memory else memory) + self.step_overhead_s

    def decode_run_s(self, positions: Sequence[int]) -> Iterator[float]:
        n = len(positions)
        kv_read = sum(positions)
        windows = self._windows
        if not windows:
            return self._full_attention_run_s(n, kv_read)
        return self._window_run_s(positions, n, kv_read, windows)

    def decode_run_clock(
        self,
        positions: Sequence[int],
        start: float,
        until: float,
        max_steps: int,
        shared_kv_tokens: int = 0,  # not read (reads_distinct_kv is False)
    ) -> tuple[list[float], list[float]]:
        if self._windows:
            return run_clock(self.decode_run_s(positions), start, until, max_steps)
        # hot path: `run_clock` of `_full_attention_run_s`, the generator unrolled into it
        n = len(positions)
        # kv_read + new tokens of the first step, as a float: exact below 2**53 (and so is
        # each sum below), so `s * tokens` is the product step_time_s takes of the int; float
        # arithmetic alone takes the interpreter's fast paths
        tokens = float(sum(positions) + n)
        step = float(n)
        linear = self._s_per_token * n
        s_pair, weights, s_kv = self._s_per_pair, self._weights_s, self._s_per_kv_token
        overhead = self.step_overhead_s
        durations: list[float] = []
        starts = [start]
        t = start
        if linear <= weights and s_pair <= s_kv:
            # Memory-bound at every context: compute <= memory term by term, and rounding is
            # monotone, so `compute > memory` never holds in floats either. The same sums
            # as below, without the compute side.
            for _ in range(max_steps):
                dt = weights + s_kv * tokens + overhead
                t += dt
                durations.append(dt)
                starts.append(t)
                if t >= until:
                    break
                tokens += step
            return durations, starts
        for _ in range(max_steps):  # the same operations, in the same order, as step_time_s
            compute = linear + s_pair * tokens
            memory = weights + s_kv * tokens
            dt = (compute if compute > memory else memory) + overhead
            t += dt
            durations.append(dt)
            starts.append(t)
            if t >= until:
                break
            tokens += step
        return durations, starts

    def _full_attention_run_s(self, n: int, kv_read: int) -> Iterator[float]:
        linear = self._s_per_token * n
        s_pair, weights, s_kv = self._s_per_pair, self._weights_s, self._s_per_kv_token
        overhead = self.step_overhead_s
        while True:  # hot path: the same operations, in the same order, as step_time_s
            tokens = kv_read + n
            compute = linear + s_pair * tokens
            memory = weights + s_kv * tokens
            yield (compute if compute > memory else memory) + overhead
            kv_read += n

    def _window_run_s(
        self, positions: Sequence[int], n: int, kv_read: int, windows: tuple[int, ...]
    ) -> Iterator[float]:
        step = 0
        while True:  # hot path: the same operations, in the same order, as step_time_s
            compute = self._s_per_token * n + self._s_per_pair * (kv_read + n)
            memory = self._weights_s + self._s_per_kv_token * (kv_read + n)
            for i, size in enumerate(windows):
                compute += self._s_per_window_pair[i] * sum(
                    min(p + step + 1, size) for p in positions
                )
                memory += self._s_per_window_kv[i] * (
                    sum(min(p + step, size) for p in positions) + n
                )
            yield (compute if compute > memory else memory) + self.step_overhead_s
            kv_read += n
            step += 1

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
        hybrid = f", {self.geometry.describe_layers()}" if self.geometry.is_hybrid else ""
        return (
            f"roofline {self.geometry.name} on {self.node.name} (TP={self.tp_degree}{hybrid}): "
            f"{a.peak_flops / 1e12:.0f} TFLOP/s x MFU {self.mfu:.2f}, "
            f"{a.hbm_bw_bytes_s / 1e12:.2f} TB/s x {self.hbm_efficiency:.2f}, "
            f"+{self.step_overhead_s * 1e3:.1f} ms/step"
        )
