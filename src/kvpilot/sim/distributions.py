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
        The clamp is `sample`'s ``min(max(x, lo), hi)`` as two comparisons (min and max
        parse their arguments, most of their cost), skipped when there are no bounds."""
        variate, lo, hi = self._variate(), self.lo, self.hi
        if self.kind == "fixed":
            x = _clamp(self.a, lo, hi)
            return lambda rng: x
        if lo == -math.inf and hi == math.inf:
            return variate  # clamping to (-inf, inf) keeps every float, NaN included

        def draw(rng: random.Random) -> float:
            x = variate(rng)
            x = lo if lo > x else x  # _clamp, inline: the generator calls this per turn
            return hi if hi < x else x

        return draw

    def int_sampler(self, minimum: int = 0) -> Callable[[random.Random], int]:
        """`sample_int` as `sampler` binds `sample`: the variate, then the clamp, the
        rounding and the minimum in one call."""
        variate, lo, hi = self._variate(), self.lo, self.hi

        def draw_int(rng: random.Random) -> int:
            x = variate(rng)
            x = lo if lo > x else x  # _clamp, inline
            n = round(hi if hi < x else x)
            return n if n > minimum else minimum  # max(minimum, n)

        return draw_int

    def _variate(self) -> Callable[[random.Random], float]:
        """`sample`'s draw before the clamp, the parameters bound (`sampler`)."""
        a, b, kind = self.a, self.b, self.kind
        if kind == "fixed":
            return lambda rng: a
        if kind == "uniform":
            return lambda rng: rng.uniform(a, b)
        if kind == "lognormal":
            return _lognormal(a, b)
        if kind == "pareto":
            return lambda rng: a * rng.paretovariate(b)
        rate = 1.0 / a
        return lambda rng: rng.expovariate(rate)

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


def _lognormal(median: float, sigma: float) -> Callable[[random.Random], float]:
    """``median * exp(rng.gauss(0.0, sigma))`` with `random.Random.gauss` written out: the
    same two ``rng.random()`` calls, the same float operations and the same second value
    kept in ``rng.gauss_next`` for the next call (which any later ``rng.gauss`` reads too),
    so the generator's stream is unchanged; one call where there were two (the generator
    draws three of these per turn). ``gauss`` returns ``mu + z * sigma``; with ``mu = 0.0``
    that is ``z * sigma``, but for -0.0, which `math.exp` maps to 1.0 as it does 0.0."""
    exp, log, sqrt, cos, sin = math.exp, math.log, math.sqrt, math.cos, math.sin

    def draw(rng: random.Random) -> float:
        z = rng.gauss_next  # type: ignore[attr-defined]
        rng.gauss_next = None  # type: ignore[attr-defined]
        if z is None:
            x2pi = rng.random() * _TWOPI
            g2rad = sqrt(-2.0 * log(1.0 - rng.random()))
            z = cos(x2pi) * g2rad
            rng.gauss_next = sin(x2pi) * g2rad  # type: ignore[attr-defined]
        return median * exp(z * sigma)

    return draw


_TWOPI = 2.0 * math.pi  # random.TWOPI


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
