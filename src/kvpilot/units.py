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
    "": 1,
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
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> float:
    """'20GB' -> 2e10, '2.5GiB' -> 2.5 * 2**30, '640KiB', '64GB/s' (bandwidth), '1024' (bytes)."""
    match = _SIZE_RE.match(text.removesuffix("/s").removesuffix("ps"))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"cannot read size {text!r}: write a number with a unit, e.g. 20GB, 2.5GiB, 640KiB"
        )
    return float(match.group(1)) * _UNITS[unit]


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h|d)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds from "3600", "90s", "30m", "1.5h" or "1d"."""
    match = _DURATION.match(text)
    if match is None:
        raise ConfigError(f"cannot read duration {text!r}: write e.g. 3600, 90s, 30m, 1h")
    value = float(match.group(1)) * _DURATION_UNITS[(match.group(2) or "s").lower()]
    if value <= 0:
        raise ConfigError(f"duration must be positive, got {text!r}")
    return value


# -- printing: the one set of formatters for pause reasons, tables and reports ------------


def format_bytes(n: float) -> str:
    """'10.7 GB': decimal units with one decimal, as the spec writes sizes; '512 B' below 1 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def format_duration(seconds: float) -> str:
    """'850 ms', '1.25 s', '12.5 s', '125 s'; 'forever' for an infinite wait, '-' for NaN."""
    if math.isnan(seconds):
        return "-"
    if math.isinf(seconds):
        return "forever"
    if seconds < 1.0:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 10:
        return f"{seconds:.2f} s"
    return f"{seconds:.1f} s" if seconds < 100 else f"{seconds:.0f} s"


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
