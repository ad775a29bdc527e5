"""Units: sizes and durations as people write them ("20GB", "2.5GiB", "90s", "1.5h"), read
(`parse_bytes`, `parse_duration`) and printed (`format_bytes`, `format_duration`, ...)."""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from typing import Any

from kvpilot.errors import ConfigError

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_UNIT_NAMES = "B, KB, MB, GB, TB (decimal) or KiB, MiB, GiB, TiB (binary)"
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str, what: str = "size") -> float:
    """'20GB' -> 2e10, '2.5GiB' -> 2.5 * 2**30, '640KiB', '64GB/s' (a bandwidth), '512B'.

    The one parser of sizes: a bare number is an error, because "80" could be bytes or
    gigabytes and "80GB" and "80GiB" differ by 7%. ``what`` names the option in messages.
    """
    match = _SIZE_RE.match(text.removesuffix("/s").removesuffix("ps"))
    if match is not None and not match.group(2) and float(match.group(1)) == 0:
        return 0.0  # nothing is nothing in every unit
    if match is not None and not match.group(2):
        raise ConfigError(
            f"{what} {text!r} has no unit: write e.g. {match.group(1)}GB or "
            f"{match.group(1)}GiB (units: {_UNIT_NAMES})"
        )
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"cannot read {what} {text!r}: write a number with a unit, e.g. 20GB, 2.5GiB, "
            f"640KiB (units: {_UNIT_NAMES})"
        )
    return float(match.group(1)) * _UNITS[unit]


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h|d)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str, what: str = "duration") -> float:
    """Seconds from "3600", "90s", "30m", "1.5h" or "1d" (a bare number is seconds)."""
    match = _DURATION.match(text)
    if match is None:
        raise ConfigError(f"cannot read {what} {text!r}: write e.g. 3600, 90s, 30m, 1h")
    value = float(match.group(1)) * _DURATION_UNITS[(match.group(2) or "s").lower()]
    if value <= 0:
        raise ConfigError(f"{what} must be positive, got {text!r}")
    return value


# -- printing: one set of formatters, so every command writes sizes and times alike ------

_DECIMAL = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
_BINARY = (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10))


def _scaled(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}"


def format_bytes(n: float, *, binary: bool = False) -> str:
    """A size in the unit that fits: '6.4 MB', '10.7 GB', '225 GB', '512 B'.

    Decimal units by default (the spec's figures, e.g. 10.7 GB, read as in the spec);
    ``binary=True`` for sizes people set in binary units (pools of 16 GiB, 640 KiB blocks).
    """
    for unit, scale in _BINARY if binary else _DECIMAL:
        if abs(n) >= scale:
            return f"{_scaled(n / scale)} {unit}"
    return f"{n:.0f} B"


def format_rate(bytes_per_s: float) -> str:
    """A bandwidth: '338 MB/s', '64.0 GB/s'."""
    return f"{format_bytes(bytes_per_s)}/s"


def format_seconds(seconds: float) -> str:
    """A duration that reads at a glance: '628 ms', '2.35 s', '45.0 s', '12 min', 'forever'."""
    if math.isnan(seconds):
        return "-"
    if math.isinf(seconds):
        return "forever"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 100:
        return f"{seconds:.1f} s"
    if seconds < 600:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def format_byte_seconds(byte_seconds: float) -> str:
    """Memory held over time (the retain tax): '4.0 MB·s', '483 GB·s'."""
    return f"{format_bytes(byte_seconds)}·s"


def format_count(n: float) -> str:
    """'1.23k', '4.56M', '7.89G'; plain below a thousand."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_figure(x: float) -> str:
    """A figure whose unit is printed beside it: '1,234' from 10 up, 3 significant digits below."""
    return f"{x:,.0f}" if x >= 10 else f"{x:.3g}"


def format_in(value: float, unit: str, digits: int = 1) -> str:
    """``value`` (bytes or seconds) in a fixed ``unit`` for a table column headed with it:
    ``format_in(2.5e9, "GB")`` is '2.5', ``format_in(0.25, "ms", 0)`` is '250'; '∞' if infinite."""
    if math.isinf(value):
        return "∞"
    key = unit.lower()
    scale = _UNITS.get(key) or _DURATION_UNITS.get(key)
    if scale is None:
        raise ValueError(f"unknown unit {unit!r}")
    return f"{value / scale:,.{digits}f}"


def format_percent(x: float, digits: int = 1) -> str:
    """A fraction as a percentage without the sign: 0.123 -> '12.3'."""
    return f"{x * 100:.{digits}f}"


def to_jsonable(value: Any) -> Any:
    """Dataclasses, enums and tuples as JSON values; infinities and NaN become null."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
