"""Random quantities of a workload, written in YAML as a number or a small mapping.

    12                                   fixed value
    {dist: fixed, value: 12}
    {dist: uniform, low: 1, high: 30}
    {dist: lognormal, median: 600, sigma: 1.2}     heavy-tailed; mean = median * e^(sigma^2/2)
    {dist: pareto, scale: 200, alpha: 1.5}         heavier; P(X > x) = (scale / x)^alpha
    {dist: exponential, mean: 10}

Any of them takes ``min`` and ``max`` to clamp the draw.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpilot.errors import ConfigError

_PARAMS: dict[str, tuple[str, ...]] = {
    "fixed": ("value",),
    "uniform": ("low", "high"),
    "lognormal": ("median", "sigma"),
    "pareto": ("scale", "alpha"),
    "exponential": ("mean",),
}


@dataclass(frozen=True, slots=True)
class Dist:
    kind: str
    a: float
    b: float = 0.0
    lo: float = -math.inf
    hi: float = math.inf

    def __post_init__(self) -> None:
        if self.kind not in _PARAMS:
            raise ConfigError(f"unknown distribution {self.kind!r}: use one of {sorted(_PARAMS)}")
        if self.lo > self.hi:
            raise ConfigError(f"{self.kind} distribution: min {self.lo} exceeds max {self.hi}")
        bad = (
            (self.kind == "uniform" and self.b < self.a)
            or (self.kind == "lognormal" and (self.a <= 0 or self.b < 0))
            or (self.kind == "pareto" and (self.a <= 0 or self.b <= 0))
            or (self.kind == "exponential" and self.a <= 0)
        )
        if bad:
            names = _PARAMS[self.kind]
            raise ConfigError(
                f"{self.kind} distribution: invalid parameters "
                f"{dict(zip(names, (self.a, self.b), strict=False))}"
            )

    @classmethod
    def fixed(cls, value: float) -> Dist:
        return cls("fixed", float(value))

    def sample(self, rng: random.Random) -> float:
        k = self.kind
        if k == "fixed":
            x = self.a
        elif k == "uniform":
            x = rng.uniform(self.a, self.b)
        elif k == "lognormal":
            x = self.a * math.exp(rng.gauss(0.0, self.b))
        elif k == "pareto":
            x = self.a * rng.paretovariate(self.b)
        else:
            x = rng.expovariate(1.0 / self.a)
        return min(max(x, self.lo), self.hi)

    def sample_int(self, rng: random.Random, minimum: int = 0) -> int:
        return max(minimum, round(self.sample(rng)))

    def sampler(self) -> Callable[[random.Random], float]:
        """`sample` with the kind chosen and the parameters bound once: the same calls on
        ``rng`` and the same floats, for the workload generator's draws (a few per turn).
        The clamp is `_clamp`, `sample`'s ``min(max(x, lo), hi)`` without min and max's
        argument parsing (most of their cost)."""
        a, b, lo, hi = self.a, self.b, self.lo, self.hi
        kind = self.kind
        if kind == "fixed":
            x = _clamp(a, lo, hi)
            return lambda rng: x
        if kind == "uniform":
            return lambda rng: _clamp(rng.uniform(a, b), lo, hi)
        if kind == "lognormal":
            exp = math.exp
            return lambda rng: _clamp(a * exp(rng.gauss(0.0, b)), lo, hi)
        if kind == "pareto":
            return lambda rng: _clamp(a * rng.paretovariate(b), lo, hi)
        rate = 1.0 / a
        return lambda rng: _clamp(rng.expovariate(rate), lo, hi)

    def int_sampler(self, minimum: int = 0) -> Callable[[random.Random], int]:
        """`sample_int` as `sampler` binds `sample`."""
        draw = self.sampler()

        def draw_int(rng: random.Random) -> int:
            n = round(draw(rng))
            return n if n > minimum else minimum  # max(minimum, n)

        return draw_int

    def median(self) -> float:
        """The distribution's median before clamping (for summaries and hints)."""
        k = self.kind
        if k == "fixed":
            m = self.a
        elif k == "uniform":
            m = (self.a + self.b) / 2
        elif k == "lognormal":
            m = self.a
        elif k == "pareto":
            m = self.a * 2 ** (1 / self.b)
        else:
            m = self.a * math.log(2)
        return min(max(m, self.lo), self.hi)

    def describe(self) -> str:
        names = _PARAMS[self.kind]
        args = ", ".join(f"{n}={v:g}" for n, v in zip(names, (self.a, self.b), strict=False))
        clamp = ""
        if self.lo > -math.inf or self.hi < math.inf:
            clamp = f" in [{self.lo:g}, {self.hi:g}]"
        return f"{self.kind}({args}){clamp}"


def _clamp(x: float, lo: float, hi: float) -> float:
    """``min(max(x, lo), hi)``, the same float: max keeps ``x`` unless ``lo > x``, min keeps
    that unless ``hi`` is less (so a NaN passes through, as with min and max)."""
    x = lo if lo > x else x
    return hi if hi < x else x


def parse_dist(value: Any, where: str) -> Dist:
    """A `Dist` from a YAML number or mapping; ``where`` names the key in error messages."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a number or a distribution, got {value!r}")
    if isinstance(value, int | float):
        return Dist.fixed(value)
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a number or a distribution mapping, got {value!r}")
    spec = dict(value)
    kind = spec.pop("dist", "fixed")
    if kind not in _PARAMS:
        raise ConfigError(f"{where}: unknown dist {kind!r}; use one of {sorted(_PARAMS)}")
    names = _PARAMS[kind]
    lo = spec.pop("min", -math.inf)
    hi = spec.pop("max", math.inf)
    missing = [n for n in names if n not in spec]
    unknown = sorted(set(spec) - set(names))
    if missing or unknown:
        raise ConfigError(
            f"{where}: a {kind} distribution takes {list(names)} (and optional min, max); "
            f"missing {missing}, unknown {unknown}"
        )
    try:
        params = [float(spec[n]) for n in names]
        b = params[1] if len(params) > 1 else 0.0
        return Dist(kind, params[0], b, lo=float(lo), hi=float(hi))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: distribution parameters must be numbers ({exc})") from exc
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
