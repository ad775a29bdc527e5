"""Provider-style prompt caching on the server: pins, usage, the ledger and prefix breaks.

One `PromptCache` per app. Its parts live on two threads:

* the `PinTable` (breakpoints held for their TTL) changes engine state, so it is touched
  only inside engine commands: ``reuse_limit`` while a request is added, ``after`` once it
  has finished;
* the break detectors (one per session or ``prompt_cache_key`` group), the ledger and the
  Prometheus counters are used from the event loop.

A request's usage is built from what the engine did (`promptcache.usage.split_usage`) and
recorded in the ledger, so the ledger's totals are the sum of the responses' usage.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter

from kvpilot.engine import Engine
from kvpilot.engine.prefix_pins import RadixHolder, pin_inputs
from kvpilot.memory import RadixNode
from kvpilot.promptcache.breaks import BreakCause, PrefixBreak, PromptView
from kvpilot.promptcache.conversations import BreakDetector
from kvpilot.promptcache.ledger import RequestUsage, UsageLedger
from kvpilot.promptcache.pins import PinTable
from kvpilot.promptcache.placement import place_pin
from kvpilot.promptcache.prices import PriceTable
from kvpilot.promptcache.usage import Breakpoint, cacheable, check_ttl_order, split_usage

log = logging.getLogger("kvpilot.prefix_break")

TTL_5M_S = 300.0
TTL_1H_S = 3600.0
RETENTION_24H_S = 86400.0
MAX_GROUPS = 10_000  # break detectors kept (least recently used dropped)


@dataclass(frozen=True, slots=True)
class PromptCacheConfig:
    min_cacheable_tokens: int = 1024  # a breakpoint before this many tokens caches nothing
    max_pinned_fraction: float = 0.5  # of the device KV pool that pins may hold
    ledger_dir: Path | None = None  # None: the ledger lives in memory
    prices: PriceTable = field(default_factory=PriceTable)
    clock: Callable[[], float] = time.monotonic  # TTLs run on it (tests inject one)
    wall_clock: Callable[[], float] = time.time  # the ledger's hours


@dataclass(frozen=True, slots=True)
class CacheOutcome:
    """What prompt caching did for one finished request."""

    usage: RequestUsage
    pinned: tuple[dict[str, Any], ...]  # per breakpoint: position, tokens pinned, ttl, tier


class PromptCache:
    def __init__(
        self, engine: Engine, config: PromptCacheConfig, registry: CollectorRegistry
    ) -> None:
        self.config = config
        self.block_size = engine.kv.block_size
        pool_tokens = engine.kv.device.num_blocks * self.block_size
        self.pins: PinTable[RadixNode] = PinTable(
            self.block_size,
            RadixHolder(engine.kv),
            config.clock,
            budget_tokens=int(pool_tokens * config.max_pinned_fraction),
        )
        self.ledger = UsageLedger(config.ledger_dir, config.prices)
        self._detectors: OrderedDict[tuple[str, ...], BreakDetector] = OrderedDict()
        self.breaks_by_group: dict[tuple[str, ...], Counter[str]] = {}
        self.last_break: dict[tuple[str, ...], dict[str, Any]] = {}
        self.prefix_breaks = PromCounter(
            "kvpilot_prefix_breaks",
            "Requests that diverged from their session's (or prompt_cache_key group's) "
            "previous prompt before its end, by classified cause",
            ["cause"],
            registry=registry,
        )
        for cause in BreakCause:
            self.prefix_breaks.labels(str(cause))
        self.usage_tokens = PromCounter(
            "kvpilot_usage_tokens",
            "Billed tokens by tenant, model and kind (input, cached_read, cache_write, output)",
            ["tenant", "model", "kind"],
            registry=registry,
        )
        self.usage_cost = PromCounter(
            "kvpilot_usage_cost",
            "Cost of the billed tokens from the price table (--prices), by tenant and model",
            ["tenant", "model"],
            registry=registry,
        )

    def close(self) -> None:
        self.ledger.close()

    # -- engine thread --------------------------------------------------------------------

    def reuse_limit(self, tokens: list[int], salt: str | None) -> int:
        """A request with breakpoints reads only pinned prefixes: the longest live one."""
        pin = self.pins.longest_live(tokens, salt)
        return pin.tokens if pin is not None else 0

    def after(
        self,
        engine: Engine,
        tokens: list[int],
        salt: str | None,
        breakpoints: list[Breakpoint],
        read_tokens: int,
        output_tokens: int,
    ) -> CacheOutcome:
        """The request finished: refresh the pins it read, pin its breakpoints, bill it."""
        self.pins.touch(tokens, salt, read_tokens)
        wanted = cacheable(breakpoints, self.block_size, self.config.min_cacheable_tokens)
        result = self.pins.pin(tokens, salt, wanted)
        created = set(result.created)
        pinned = [(p, ttl) for p, ttl in wanted if (p, ttl) in created or p in result.refreshed]
        usage = split_usage(len(tokens), read_tokens, pinned, result.created, output_tokens)
        described = []
        for bp in breakpoints:
            p = bp.position // self.block_size * self.block_size
            entry: dict[str, Any] = {
                "where": bp.where,
                "position": bp.position,
                "ttl_s": bp.ttl_s,
                "pinned_tokens": p if (p, bp.ttl_s) in pinned or p in result.refreshed else 0,
            }
            if entry["pinned_tokens"]:
                placement = place_pin(pin_inputs(engine, p, bp.ttl_s))
                entry["tier"] = placement.tier
                entry["placement"] = placement.reason
            elif bp.position < self.config.min_cacheable_tokens:
                entry["skipped"] = (
                    f"shorter than the minimum cacheable prompt "
                    f"({self.config.min_cacheable_tokens} tokens)"
                )
            elif p in result.over_budget:
                entry["skipped"] = (
                    f"pinned prefixes already hold {self.pins.held_tokens} tokens of the "
                    f"{self.pins.budget_tokens} they may (half the device KV pool)"
                )
            described.append(entry)
        return CacheOutcome(usage, tuple(described))

    def release_all(self) -> None:
        self.pins.release_all()

    # -- event loop -----------------------------------------------------------------------

    def observe(self, group: tuple[str, ...], view: PromptView) -> PrefixBreak | None:
        """Compare a request with its group's previous one; report and count a break."""
        detector = self._detectors.get(group)
        if detector is None:
            detector = self._detectors[group] = BreakDetector(self.block_size)
            if len(self._detectors) > MAX_GROUPS:
                old, _ = self._detectors.popitem(last=False)
                self.breaks_by_group.pop(old, None)
                self.last_break.pop(old, None)
        self._detectors.move_to_end(group)
        seen = detector.observe(view)
        brk = seen.prefix_break
        if brk is None:
            return None
        self.prefix_breaks.labels(str(brk.cause)).inc()
        self.breaks_by_group.setdefault(group, Counter())[str(brk.cause)] += 1
        report = {"group": list(group), "conversation": seen.conversation, **brk.to_json()}
        self.last_break[group] = report
        log.info(json.dumps({"event": "prefix_break", **report}, ensure_ascii=False))
        return brk

    def describe_group(self, group: tuple[str, ...]) -> dict[str, Any]:
        detector = self._detectors.get(group)
        convs = detector.all_conversations() if detector is not None else []
        return {
            "prefix_breaks": dict(self.breaks_by_group.get(group, {})),
            "last_prefix_break": self.last_break.get(group),
            "conversations": [
                {"conversation": c.number, "requests": c.requests, "h_prefix": c.reuse_rate}
                for c in convs
            ],
        }

    def bill(
        self, usage: RequestUsage, *, model: str, tenant: str | None, api_key: str | None
    ) -> float:
        cost = self.ledger.record(
            usage, model=model, tenant=tenant, api_key=api_key, now_s=self.config.wall_clock()
        )
        label = tenant or "anonymous"
        for kind, n in (
            ("input", usage.input_tokens),
            ("cached_read", usage.cached_read_tokens),
            ("cache_write", usage.cache_write_tokens),
            ("output", usage.output_tokens),
        ):
            self.usage_tokens.labels(label, model, kind).inc(n)
        self.usage_cost.labels(label, model).inc(cost)
        return cost


def parse_breakpoints(raw: list[tuple[int, float, str]]) -> list[Breakpoint]:
    breakpoints = [Breakpoint(p, ttl, where) for p, ttl, where in raw]
    check_ttl_order(breakpoints)
    return breakpoints
