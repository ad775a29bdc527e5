"""What tokens cost: the price table behind the usage ledger (``--prices FILE``, TOML).

Prices are per million tokens, in whatever currency the file means. A model's table may
give only ``input`` and ``output``; the cache prices then follow the usual provider ratios
to the input price: cached reads 10%, cache writes 125% (5-minute TTL) or 200% (1 hour and
longer). With no file at all every model costs 1 per million input tokens and 4 per
million output tokens::

    [default]             # any model not named below
    input = 3.0
    output = 15.0
    # cached_read = 0.3   # optional: defaults to 10% of input
    # cache_write_5m = 3.75
    # cache_write_1h = 6.0

    [models."qwen2.5-7b"]
    input = 0.5
    output = 1.5
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpilot.errors import ConfigError

CACHED_READ_RATIO = 0.10
CACHE_WRITE_RATIO = {"5m": 1.25, "1h": 2.0}
_FIELDS = ("input", "output", "cached_read", "cache_write_5m", "cache_write_1h")


@dataclass(frozen=True, slots=True)
class ModelPrices:
    """Per million tokens."""

    input: float = 1.0
    output: float = 4.0
    cached_read: float = 0.1
    cache_write_5m: float = 1.25
    cache_write_1h: float = 2.0

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str) -> ModelPrices:
        unknown = set(data) - set(_FIELDS)
        if unknown:
            raise ConfigError(
                f"{where}: unknown price field(s) {sorted(unknown)}; known: {', '.join(_FIELDS)}"
            )
        values: dict[str, float] = {}
        for name in _FIELDS:
            if name in data:
                v = data[name]
                if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                    raise ConfigError(f"{where}.{name}: a price is a number >= 0, got {v!r}")
                values[name] = float(v)
        base = values.setdefault("input", _DEFAULT.input)
        values.setdefault("output", _DEFAULT.output)
        values.setdefault("cached_read", base * CACHED_READ_RATIO)
        values.setdefault("cache_write_5m", base * CACHE_WRITE_RATIO["5m"])
        values.setdefault("cache_write_1h", base * CACHE_WRITE_RATIO["1h"])
        return cls(**values)

    def write_price(self, ttl_s: float) -> float:
        """The price of a cache write held for ``ttl_s`` (the 1-hour price past 5 minutes)."""
        return self.cache_write_5m if ttl_s <= 300 else self.cache_write_1h

    def cost(
        self,
        *,
        input_tokens: int,
        cached_read_tokens: int,
        cache_write_tokens_by_ttl: Mapping[float, int],
        output_tokens: int,
    ) -> float:
        total = (
            input_tokens * self.input
            + cached_read_tokens * self.cached_read
            + output_tokens * self.output
            + sum(n * self.write_price(ttl) for ttl, n in cache_write_tokens_by_ttl.items())
        )
        return total / 1e6


_DEFAULT = ModelPrices()


@dataclass(frozen=True, slots=True)
class PriceTable:
    default: ModelPrices = field(default_factory=ModelPrices)
    models: Mapping[str, ModelPrices] = field(default_factory=dict)

    def for_model(self, model: str) -> ModelPrices:
        return self.models.get(model, self.default)

    @classmethod
    def load(cls, path: str | Path) -> PriceTable:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read the price table {p}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML ({exc})") from exc
        unknown = set(data) - {"default", "models"}
        if unknown:
            raise ConfigError(f"{p}: unknown table(s) {sorted(unknown)}; use [default], [models.X]")
        default = ModelPrices.from_mapping(data.get("default", {}), f"{p}: default")
        models = data.get("models", {})
        if not isinstance(models, dict):
            raise ConfigError(f'{p}: models is a table of tables ([models."name"])')
        return cls(
            default,
            {
                name: ModelPrices.from_mapping(table, f"{p}: models.{name}")
                for name, table in models.items()
            },
        )
