"""Prompt caching's pure parts: pins on virtual time, the usage split, prices, the ledger."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.errors import ConfigError, InvalidRequest
from kvpilot.policy.breakeven import PauseInputs
from kvpilot.promptcache.ledger import RequestUsage, UsageLedger, totals
from kvpilot.promptcache.pins import PinTable
from kvpilot.promptcache.placement import place_pin
from kvpilot.promptcache.prices import ModelPrices, PriceTable
from kvpilot.promptcache.usage import Breakpoint, cacheable, check_ttl_order, split_usage

B = 4


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeHolder:
    """Holds whatever is 'cached': prefixes of any token list it was told about."""

    def __init__(self, cached: int = 10**9) -> None:
        self.cached = cached
        self.held: dict[int, int] = {}
        self._ids = 0

    def hold(self, salt: str | None, tokens: Sequence[int]) -> tuple[int, int] | None:
        covered = min(len(tokens), self.cached) // B * B
        if not covered:
            return None
        self._ids += 1
        self.held[self._ids] = covered
        return self._ids, covered

    def release(self, handle: int) -> None:
        del self.held[handle]


def test_pin_lives_for_its_ttl_and_each_hit_refreshes_it() -> None:
    clock, holder = Clock(), FakeHolder()
    table = PinTable(B, holder, clock)
    tokens = list(range(40))
    result = table.pin(tokens, "t", [(16, 300.0)])
    assert result.created == ((16, 300.0),) and len(holder.held) == 1
    clock.t = 299
    pin = table.longest_live([*tokens[:20], 99], "t")
    assert pin is not None and pin.tokens == 16
    table.touch(tokens, "t", 16)  # a hit at 299 s: alive until 599 s
    clock.t = 598
    assert table.longest_live(tokens, "t") is not None
    clock.t = 600
    assert table.longest_live(tokens, "t") is None
    assert holder.held == {}  # released when the TTL lapsed


def test_pins_are_per_salt_and_longest_first() -> None:
    table = PinTable(B, FakeHolder(), Clock())
    tokens = list(range(64))
    table.pin(tokens, "a", [(8, 3600.0), (32, 300.0)])
    assert table.longest_live(tokens, "a").tokens == 32  # type: ignore[union-attr]
    assert table.longest_live(tokens[:20], "a").tokens == 8  # type: ignore[union-attr]
    assert table.longest_live(tokens, "b") is None
    again = table.pin(tokens, "a", [(8, 3600.0), (32, 300.0)])
    assert again.created == () and again.refreshed == (8, 32)
    table.check_invariants()
    table.release_all()
    assert len(table) == 0


def test_pins_stay_within_their_budget() -> None:
    holder = FakeHolder()
    table = PinTable(B, holder, Clock(), budget_tokens=40)
    first = table.pin(list(range(64)), "a", [(16, 300.0), (32, 300.0)])
    assert first.created == ((16, 300.0),) and first.over_budget == (32,)
    assert table.held_tokens == 16 and len(holder.held) == 1
    table.check_invariants()


def test_a_prefix_no_longer_cached_is_not_pinned() -> None:
    table = PinTable(B, FakeHolder(cached=8), Clock())
    result = table.pin(list(range(32)), None, [(16, 300.0)])
    assert result.created == () and len(table) == 0


def test_usage_split_bills_each_new_span_at_its_ttl() -> None:
    u = split_usage(100, 0, [(32, 3600.0), (64, 300.0)], [(32, 3600.0), (64, 300.0)], 7)
    assert u.cache_write_tokens_by_ttl == {3600.0: 32, 300.0: 32}
    assert u.input_tokens == 36 and u.cached_read_tokens == 0 and u.output_tokens == 7
    read = split_usage(100, 32, [(32, 3600.0), (64, 300.0)], [(64, 300.0)], 7)
    assert read.cache_write_tokens_by_ttl == {300.0: 32} and read.input_tokens == 36


@given(st.integers(B, 500), st.data())
def test_usage_split_adds_up_to_the_prompt(prompt: int, data: st.DataObject) -> None:
    read = data.draw(st.integers(0, prompt - 1)) // B * B
    points = sorted(set(data.draw(st.lists(st.integers(1, prompt // B), max_size=4))))
    pinned = [(p * B, 300.0) for p in points]
    created = [x for x in pinned if data.draw(st.booleans())]
    u = split_usage(prompt, read, pinned, created, 0)
    assert u.input_tokens >= 0
    assert u.input_tokens + u.cached_read_tokens + u.cache_write_tokens == prompt


def test_breakpoints_align_down_and_skip_short_ones() -> None:
    bps = [Breakpoint(10, 300.0), Breakpoint(70, 3600.0), Breakpoint(71, 300.0)]
    assert cacheable(bps, 16, 32) == [(64, 3600.0)]


def test_longer_ttl_after_shorter_is_refused() -> None:
    check_ttl_order([Breakpoint(10, 3600.0, "a"), Breakpoint(20, 300.0, "b")])
    with pytest.raises(InvalidRequest, match="longer ttl"):
        check_ttl_order([Breakpoint(10, 300.0, "a"), Breakpoint(20, 3600.0, "b")])


def test_default_prices_make_cached_reads_a_tenth_of_input(tmp_path) -> None:
    path = tmp_path / "prices.toml"
    path.write_text('[default]\ninput = 3.0\noutput = 15.0\n[models."big"]\ninput = 10.0\n')
    table = PriceTable.load(path)
    assert table.default.cached_read == pytest.approx(0.3)
    assert table.default.cache_write_5m == pytest.approx(3.75)
    assert table.for_model("big").cache_write_1h == pytest.approx(20.0)
    assert table.for_model("other") is table.default
    assert ModelPrices().cost(
        input_tokens=10**6, cached_read_tokens=10**6, cache_write_tokens_by_ttl={}, output_tokens=0
    ) == pytest.approx(1.1)
    path.write_text('[models."out-only"]\noutput = 8.0\n')  # no input: the default's
    only = PriceTable.load(path).for_model("out-only")
    assert (only.input, only.output, only.cached_read) == pytest.approx((1.0, 8.0, 0.1))
    path.write_text("[default]\ninptu = 1\n")
    with pytest.raises(ConfigError, match="inptu"):
        PriceTable.load(path)
    path.write_text("[default]\ninput = -1\n")
    with pytest.raises(ConfigError, match=">= 0"):
        PriceTable.load(path)


def test_ledger_sums_per_hour_tenant_key_model_and_survives_reopen(tmp_path) -> None:
    ledger = UsageLedger(tmp_path)
    u = RequestUsage(100, 50, 10, {300.0: 20, 3600.0: 5})
    ledger.record(u, model="m", tenant="t", api_key="k1", now_s=7200.5)
    ledger.record(u, model="m", tenant="t", api_key="k1", now_s=7300.0)
    ledger.record(u, model="m", tenant="t", api_key="k2", now_s=11000.0)
    ledger.record(u, model="m", tenant="other", api_key="k3", now_s=7200.0)
    ledger.close()
    reopened = UsageLedger(tmp_path)
    rows = reopened.query("t", 0, 20_000)
    assert [(r.hour_start_s, r.api_key, r.requests) for r in rows] == [
        (7200, "k1", 2),
        (10800, "k2", 1),
    ]
    assert rows[0].cache_write_tokens_by_ttl == {"5m": 40, "1h": 10}
    t = totals(rows)
    assert t["input_tokens"] == 300 and t["cached_read_tokens"] == 150
    assert t["cache_write_tokens"] == 75 and t["output_tokens"] == 30
    assert reopened.query("t", 10_900, 11_000)[0].api_key == "k2"  # overlapping hour
    assert reopened.query("nobody", 0, 20_000) == []


def test_pin_placement_prefers_the_cheapest_tier_that_reloads_in_time() -> None:
    common = {
        "kv_bytes": 8e9,
        "num_tokens": 32_000,
        "device_host_bw_bytes_s": 25e9,
        "host_disk_bw_bytes_s": 5e9,
        "prefill_tokens_per_s": 10_000.0,
        "device_pressure": 0.9,
    }
    hour = place_pin(PauseInputs(expected_wait_s=3600.0, **common))
    assert hour.tier in ("host", "disk")
    short = place_pin(PauseInputs(expected_wait_s=0.1, **common))
    assert short.tier == "device"
    no_tier = place_pin(
        PauseInputs(
            **(common | {"device_host_bw_bytes_s": 0.0, "host_disk_bw_bytes_s": 0.0}),
            expected_wait_s=3600.0,
        )
    )
    assert no_tier.tier == "device" and "breakpoint asks" in no_tier.reason
