"""Units: sizes and durations as people write them ("20GB", "2.5GiB", "90s", "1.5h")."""

from __future__ import annotations

import re

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
