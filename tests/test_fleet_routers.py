"""kvpilot's router and the baselines, on a hand-built fleet view and directory."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.errors import ConfigError, NoReplicaAvailable
from kvpilot.fleet import (
    FleetView,
    KeySpace,
    PrefixDirectory,
    ReplicaLoad,
    RouterConfig,
    RouteRequest,
    decide_migration,
    make_router,
)
from kvpilot.fleet.directory import TierMatch
from kvpilot.fleet.events import EventBatch, KVEvent, KVEventKind, ReplicaSnapshot
from kvpilot.fleet.ray_prefix import PrefixTree, common_prefix_len
from kvpilot.fleet.scoring import matched_tokens, tier_weights
from kvpilot.memory import Tier

SPACE = KeySpace(16)
PROMPT = list(range(1, 16 * 40 + 1))  # 40 blocks


def fleet_with(names: list[str]) -> tuple[FleetView, PrefixDirectory]:
    fleet = FleetView(names)
    directory = PrefixDirectory(SPACE.key_space_id)
    for name in names:
        directory.add_replica(name)
        directory.load_snapshot(name, ReplicaSnapshot(f"e-{name}", 0, SPACE.key_space_id))
    return fleet, directory


def hold(
    directory: PrefixDirectory, name: str, tokens: list[int], tier: Tier = Tier.DEVICE
) -> None:
    epoch, seq = directory.sync_state(name)
    kind = KVEventKind.COMMITTED if tier is Tier.DEVICE else KVEventKind.MOVED
    event = KVEvent(seq + 1, kind, tier, SPACE.keys(tokens))
    assert directory.apply(name, EventBatch(epoch or "", seq + 1, (event,)))


def report(fleet: FleetView, name: str, **load: float) -> None:
    fleet[name].on_report(ReplicaLoad(time_s=0.0, block_bytes=1e6, **load))  # type: ignore[arg-type]


def test_prefers_the_replica_holding_the_prefix() -> None:
    fleet, directory = fleet_with(["a", "b", "c"])
    hold(directory, "b", PROMPT[: 16 * 30])
    router = make_router("kvpilot", fleet, directory=directory)
    decision = router.route(RouteRequest("r1", PROMPT), 0.0)
    assert decision.replica == "b"
    assert decision.matched_tokens == 16 * 30


def test_load_outweighs_the_hit_past_the_objective_balance() -> None:
    fleet, directory = fleet_with(["a", "b"])
    hold(directory, "a", PROMPT[: 16 * 20])  # half the prompt
    config = RouterConfig(mu=0.5, gamma=1.0, l_max_tokens=10_000, kv_weight=0.0)
    router = make_router("kvpilot", fleet, directory=directory, config=config)
    report(fleet, "a", waiting_tokens=4_000)  # 0.5*0.5 - 0.5*0.4 = 0.05 > 0: still a
    assert router.route(RouteRequest("r1", PROMPT), 0.0).replica == "a"
    report(fleet, "a", waiting_tokens=6_000)  # 0.25 - 0.30 < 0: b
    assert router.route(RouteRequest("r2", PROMPT), 0.0).replica == "b"


def test_pending_tokens_spread_a_burst_until_the_next_report() -> None:
    fleet, directory = fleet_with(["a", "b"])
    config = RouterConfig(mu=0.5, gamma=1.0, l_max_tokens=1_000, kv_weight=0.0)
    router = make_router("kvpilot", fleet, directory=directory, config=config)
    chosen = []
    for i in range(4):
        request = RouteRequest(f"r{i}", [i * 7 + 1] * 320)
        decision = router.route(request, now=1.0)
        router.on_routed(request, decision, 1.0)
        chosen.append(decision.replica)
    assert sorted(chosen) == ["a", "a", "b", "b"]
    assert fleet["a"].pending_tokens == 640
    fleet["a"].on_report(ReplicaLoad(time_s=1.0))
    assert fleet["a"].pending_tokens == 0


def test_host_blocks_count_by_the_recompute_time_they_save() -> None:
    load = ReplicaLoad(
        prefill_tokens_per_s=16_000,
        block_bytes=1e6,
        device_host_bw_bytes_s=2e9,
        host_disk_bw_bytes_s=0.5e9,
        block_size=16,
    )
    w_host, w_disk = tier_weights(load)
    # recompute one block: 1 ms; reload it: 0.5 ms from host, 2 ms from disk (no gain).
    assert w_host == pytest.approx(0.5)
    assert w_disk == 0.0
    got = matched_tokens(TierMatch(device=2, host=2, disk=2), load)
    assert got == pytest.approx(16 * (2 + 1))


def test_session_stays_home_until_moving_pays() -> None:
    fleet, directory = fleet_with(["home", "other"])
    hold(directory, "home", PROMPT)
    config = RouterConfig(l_max_tokens=1_000, session_overload=1.0, kv_weight=0.0)
    router = make_router("kvpilot", fleet, directory=directory, config=config)
    turn = RouteRequest("t1", PROMPT, session="s1")
    first = router.route(turn, 0.0)
    router.on_routed(turn, first, 0.0)
    assert first.replica == "home"
    nxt = RouteRequest("t2", PROMPT + [7] * 16, session="s1")  # home holds 640 of 656
    report(fleet, "home", waiting_tokens=30_000, prefill_tokens_per_s=10_000)  # 3 s queue
    report(fleet, "other", waiting_tokens=0, prefill_tokens_per_s=10_000)
    decision = router.route(nxt, 1.0)
    assert decision.replica == "other" and decision.migration is not None
    assert decision.migration.migrate and decision.migration.via == "recompute"
    assert decision.migration.move_s == pytest.approx(0.064)
    # Both queues long, other's shorter (the objective prefers it), but by less than twice
    # the 64 ms rebuild: the session stays.
    report(fleet, "home", waiting_tokens=12_000, prefill_tokens_per_s=10_000)
    report(fleet, "other", waiting_tokens=11_000, prefill_tokens_per_s=10_000)
    decision = router.route(nxt, 2.0)
    assert decision.replica == "home" and decision.migration is not None
    assert not decision.migration.migrate and "twice" in decision.reason
    report(fleet, "home", waiting_tokens=500, prefill_tokens_per_s=10_000)
    decision = router.route(nxt, 3.0)
    assert decision.replica == "home" and decision.migration is None


def test_migration_reloads_from_a_shared_disk_when_that_is_faster() -> None:
    fleet = FleetView(["home", "target"])
    fleet["home"].on_report(ReplicaLoad(waiting_tokens=10**6, prefill_tokens_per_s=1_000))
    fleet["target"].on_report(
        ReplicaLoad(
            prefill_tokens_per_s=1_000,
            block_bytes=1e6,
            device_host_bw_bytes_s=10e9,
            host_disk_bw_bytes_s=1e9,
        )
    )
    local = decide_migration(fleet["home"], 32_000, fleet["target"], 0, RouterConfig())
    shared = decide_migration(
        fleet["home"], 32_000, fleet["target"], 0, RouterConfig(shared_disk=True)
    )
    assert local.via == "recompute" and local.move_s == pytest.approx(32.0)
    assert shared.via == "shared disk" and shared.move_s == pytest.approx(2.0)
    assert shared.migrate and "shared disk" in shared.reason


def test_dead_home_reroutes_the_session() -> None:
    fleet, directory = fleet_with(["a", "b"])
    hold(directory, "a", PROMPT)
    router = make_router("kvpilot", fleet, directory=directory)
    turn = RouteRequest("t1", PROMPT, session="s")
    router.on_routed(turn, router.route(turn, 0.0), 0.0)
    fleet["a"].live = False
    directory.set_live("a", False)
    decision = router.route(RouteRequest("t2", PROMPT, session="s"), 1.0)
    assert decision.replica == "b" and "down" in decision.reason
    fleet["b"].live = False
    with pytest.raises(NoReplicaAvailable):
        router.route(RouteRequest("t3", PROMPT, session="s"), 2.0)


def test_prompt_cache_key_groups_requests() -> None:
    fleet, directory = fleet_with(["a", "b", "c"])
    router = make_router("kvpilot", fleet, directory=directory)
    first = RouteRequest("r1", [5] * 64, cache_key="agent-42")
    home = router.route(first, 0.0)
    router.on_routed(first, home, 0.0)
    for i in range(5):
        other = RouteRequest(f"r{i + 2}", [9 + i] * 64, cache_key="agent-42")
        assert router.route(other, 0.0).replica == home.replica


def test_round_robin_and_power_of_two() -> None:
    fleet = FleetView(["a", "b", "c"])
    rr = make_router("round_robin", fleet)
    assert [rr.route(RouteRequest(str(i), [1]), 0).replica for i in range(4)] == list("abca")
    fleet["a"].ongoing = 5
    fleet["b"].ongoing = 5
    p2 = make_router("power_of_two", fleet, seed=1)
    picks = [p2.route(RouteRequest(str(i), [1]), 0).replica for i in range(60)]
    assert picks.count("c") > 30  # c wins whenever it is sampled (2 of 3 pairs)


def test_session_hash_moves_only_the_keys_of_a_removed_replica() -> None:
    fleet = FleetView(["a", "b", "c", "d"])
    router = make_router("session_hash", fleet)
    keys = [f"s{i}" for i in range(300)]
    before = {k: router.route(RouteRequest("x", [1], session=k), 0).replica for k in keys}
    assert len(set(before.values())) == 4
    fleet["c"].live = False
    after = {k: router.route(RouteRequest("x", [1], session=k), 0).replica for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "c")
    assert "c" not in after.values()


def test_ray_prefix_follows_its_documented_algorithm() -> None:
    fleet = FleetView(["a", "b", "c"])
    router = make_router("ray_prefix", fleet, seed=0)
    sent = RouteRequest("r1", [], text="You are a helpful agent. Task one")
    d1 = router.route(sent, 0)
    router.on_routed(sent, d1, 0)
    same = RouteRequest("r2", [], text="You are a helpful agent. Task two")
    assert router.route(same, 0).replica == d1.replica  # >= 10% match: the owner
    other = RouteRequest("r3", [], text="Completely different words here")
    assert router.route(other, 0).replica != d1.replica  # < 10%: a smallest tenant
    fleet[d1.replica].ongoing = 20  # imbalanced (> 10): power of two, never the busy one
    assert all(router.route(same, 0).replica != d1.replica for _ in range(20))


@settings(max_examples=60, deadline=None)
@given(
    inserts=st.lists(
        st.tuples(st.text("ab", min_size=1, max_size=12), st.sampled_from(["x", "y"])),
        min_size=1,
        max_size=12,
    ),
    query=st.text("ab", max_size=14),
)
def test_ray_prefix_tree_matches_brute_force(inserts: list[tuple[str, str]], query: str) -> None:
    tree = PrefixTree()
    for text, tenant in inserts:
        tree.insert(text, tenant)
    for tenants in ({"x"}, {"y"}, {"x", "y"}):
        owned = [t for t, who in inserts if who in tenants]
        best = max((common_prefix_len(t, query, 0) for t in owned), default=0)
        matched, owners = tree.prefix_match(query, tenants)
        assert matched == best
        if owned and matched:
            assert (
                owners
                == {
                    who
                    for t, who in inserts
                    if who in tenants and common_prefix_len(t, query, 0) >= matched
                }
                & owners
            )
    total = {who: 0 for _, who in inserts}
    assert set(tree.chars) == set(total)


def test_common_prefix_len() -> None:
    rng = random.Random(0)
    for _ in range(200):
        a = "".join(rng.choice("ab") for _ in range(rng.randint(0, 30)))
        b = "".join(rng.choice("ab") for _ in range(rng.randint(0, 30)))
        expected = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        assert common_prefix_len(a, "zz" + b, 2) == expected


def test_router_config_is_validated() -> None:
    with pytest.raises(ConfigError):
        RouterConfig(mu=1.5)
    with pytest.raises(ConfigError):
        RouterConfig(gamma=0.5)
    with pytest.raises(ConfigError):
        RouterConfig(l_max_tokens=math.inf)
    with pytest.raises(ConfigError, match="unknown router"):
        make_router("fastest", FleetView(["a"]))
