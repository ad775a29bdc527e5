"""A measured step profile (``kvpilot calibrate``) and the cost model it defines.

`CalibratedCostModel` is a least-squares fit of measured step times (see
`kvpilot.sim.calibrate`)::

    step = a + b * prefill_tokens + c * decode_seqs + d * kv_read_tokens + e * attention_pairs
           + f * distinct_kv_tokens

``distinct_kv_tokens`` is the KV read with each cached slot counted once however many
sequences of the step read it (`BatchShape.distinct_kv_tokens`): a prefix that several
sequences read (agent sessions sharing a system prompt) stays in the CPU's cache after the
first read, so its tokens cost ``d`` each, and distinct ones ``d + f``.

Profiles of version 1 (before ``distinct_kv_tokens``) load with ``f = 0``: their fit never
saw the feature, and the model then gives exactly the times it gave them before.

It describes the model it was measured on as the engine runs it today: every layer full
attention (the engine keeps every layer's KV), so it carries no window figures.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvpilot.errors import ConfigError
from kvpilot.sim.batch_shape import BatchShape
from kvpilot.sim.cost_model import run_clock

PROFILE_KIND = "kvpilot-step-profile"
PROFILE_VERSION = 2
PROFILE_FEATURES: tuple[str, ...] = (
    "const",
    "prefill_tokens",
    "decode_seqs",
    "kv_read_tokens",
    "attention_pairs",
    "distinct_kv_tokens",
)
# The features each older version's profiles have; those they lack load as 0.
_VERSION_FEATURES: dict[int, tuple[str, ...]] = {1: PROFILE_FEATURES[:5], 2: PROFILE_FEATURES}


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
    max_model_len: int = 0  # the measured engine's context limit (0: not recorded)
    max_context_tokens: int = 0  # the longest context a measured step reached

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
        version = data.get("version")
        known = _VERSION_FEATURES.get(version) if type(version) is int else None
        if known is None:
            raise ConfigError(
                f"{source}: profile version {version!r}, this kvpilot reads versions "
                f"{sorted(_VERSION_FEATURES)}; recalibrate"
            )
        try:
            coeffs = data["coefficients_s"]
            if not isinstance(coeffs, dict):
                raise TypeError("coefficients_s must be an object")
            missing = [f for f in known if f not in coeffs]
            if missing:
                raise KeyError(f"coefficients_s lacks {missing}")
            return cls(
                model=str(data["model"]),
                device=str(data["device"]),
                dtype=str(data["dtype"]),
                block_size=int(data["block_size"]),
                coefficients_s=tuple(
                    float(coeffs[f]) if f in known else 0.0 for f in PROFILE_FEATURES
                ),
                copy_block_s=float(data["copy_block_s"]),
                samples=int(data["samples"]),
                r2=float(data["r2"]),
                median_rel_error=float(data["median_rel_error"]),
                max_model_len=int(data.get("max_model_len", 0)),
                max_context_tokens=int(data.get("max_context_tokens", 0)),
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
            + c[5] * (shape.kv_read_tokens - shape.shared_kv_tokens)
        )
        return max(t, 0.0)

    @property
    def windows(self) -> tuple[int, ...]:
        return ()

    @property
    def reads_distinct_kv(self) -> bool:
        # With a zero coefficient the term adds +0.0 whatever the count: no need to count.
        return self.profile.coefficients_s[5] != 0.0

    def decode_run_s(self, positions: Sequence[int], shared_kv_tokens: int = 0) -> Iterator[float]:
        """Each step of a decode run; ``shared_kv_tokens`` (read more than once) stays the
        same at every step, as the tokens decoded go to each sequence's own blocks."""
        n = len(positions)
        kv_read = sum(positions)
        c = self.profile.coefficients_s
        while True:  # the same operations, in the same order, as step_time_s
            t = (
                c[0]
                + c[1] * 0
                + c[2] * n
                + c[3] * kv_read
                + c[4] * (kv_read + n)
                + c[5] * (kv_read - shared_kv_tokens)
            )
            yield max(t, 0.0)
            kv_read += n

    def decode_run_clock(
        self,
        positions: Sequence[int],
        start: float,
        until: float,
        max_steps: int,
        shared_kv_tokens: int = 0,
    ) -> tuple[list[float], list[float]]:
        return run_clock(self.decode_run_s(positions, shared_kv_tokens), start, until, max_steps)

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
