"""The one set of unit formatters (pause reasons, CLI tables, simulator reports) and the one
JSON sanitiser."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from kvpilot.memory import Tier
from kvpilot.units import (
    format_bytes,
    format_count,
    format_figure,
    format_in,
    format_percent,
    format_seconds,
    to_jsonable,
)


@pytest.mark.parametrize(
    ("n", "text"),
    [(10.7e9, "10.7 GB"), (2.5e6, "2.5 MB"), (1536, "1.5 kB"), (512, "512 B"), (0, "0 B")],
)
def test_bytes_read_in_decimal_units_as_the_spec_writes_them(n: float, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.25, "250 ms"),
        (1.234, "1.23 s"),
        (45.0, "45.0 s"),
        (125.0, "125 s"),
        (3600.0, "60 min"),
        (math.inf, "forever"),
        (math.nan, "-"),
    ],
)
def test_durations_pick_their_unit(seconds: float, text: str) -> None:
    assert format_seconds(seconds) == text


def test_counts_figures_and_fixed_unit_cells() -> None:
    assert [format_count(n) for n in (999, 1234, 4.56e6, 7.891e9)] == [
        "999",
        "1.23k",
        "4.56M",
        "7.89G",
    ]
    assert format_figure(1234.4) == "1,234" and format_figure(0.012345) == "0.0123"
    assert format_in(2.5e9, "GB") == "2.5" and format_in(0.25, "ms", 0) == "250"
    assert format_in(2 << 30, "GiB", 0) == "2" and format_in(math.inf, "ms") == "∞"
    assert format_percent(0.1234) == "12.3"
    with pytest.raises(ValueError, match="unknown unit"):
        format_in(1.0, "parsecs")


def test_to_jsonable_makes_dataclasses_enums_and_infinities_json() -> None:
    @dataclasses.dataclass
    class Row:
        tier: Tier
        wait_s: float
        by_tier: dict[Tier, int]

    value = to_jsonable([Row(Tier.HOST, math.inf, {Tier.DISK: 3}), (1, math.nan)])
    assert value == [{"tier": "host", "wait_s": None, "by_tier": {"disk": 3}}, [1, None]]
    json.dumps(value, allow_nan=False)
