from __future__ import annotations

import pytest

from kvpilot.errors import ConfigError
from kvpilot.memory import KVConfig, KVManager, Tier, Trajectory


def turn(traj: Trajectory, tokens: range | list[int]) -> None:
    traj.append_tokens(tokens)
    traj.reuse_prefix()
    todo = len(traj.tokens) - traj.num_computed_tokens
    traj.allocate(todo)
    traj.mark_computed(todo)
    traj.commit()


def make_manager(device: int = 16, host: int = 0) -> KVManager:
    return KVManager(KVConfig(block_size=4, num_device_blocks=device, num_host_blocks=host))


def test_kvconfig_is_keyword_only_and_validated() -> None:
    assert KVConfig(num_device_blocks=10).block_size == 16
    with pytest.raises(TypeError):
        KVConfig(16, 10)  # type: ignore[misc]
    with pytest.raises(ConfigError, match="num_device_blocks"):
        KVConfig(num_device_blocks=0)
    with pytest.raises(ConfigError, match="block_size"):
        KVConfig(block_size=0, num_device_blocks=4)
    with pytest.raises(ConfigError, match="num_host_blocks"):
        KVConfig(num_device_blocks=4, num_host_blocks=-1)


def test_pools_exist_only_for_configured_tiers() -> None:
    mgr = KVManager(KVConfig(num_device_blocks=8, num_disk_blocks=32))
    assert set(mgr.pools) == {Tier.DEVICE, Tier.DISK}
    assert mgr.device is mgr.pools[Tier.DEVICE] and mgr.pools[Tier.DISK].num_blocks == 32
    assert mgr.radix.block_size == mgr.block_size == 16


def test_open_trajectory_registers_and_close_deregisters() -> None:
    mgr = make_manager()
    a = mgr.open_trajectory("t", [1, 2, 3])
    b = mgr.open_trajectory()
    assert a.traj_id != b.traj_id and a.salt == "t" and a.tokens.tolist() == [1, 2, 3]
    assert mgr.trajectories == {a.traj_id: a, b.traj_id: b}
    a.close()
    assert mgr.trajectories == {b.traj_id: b}


def test_free_blocks_counts_free_and_evictable_blocks() -> None:
    mgr = make_manager()
    active = mgr.open_trajectory()
    turn(active, range(8))
    idle = mgr.open_trajectory()
    turn(idle, range(100, 112))
    idle.close()
    assert mgr.device.num_free == 11
    assert mgr.free_blocks() == 14


def test_ensure_free_evicts_until_enough() -> None:
    mgr = make_manager(device=8)
    idle = mgr.open_trajectory()
    turn(idle, range(24))
    idle.close()
    assert mgr.ensure_free(4)
    assert mgr.device.num_free == 4 and mgr.radix.cached_blocks() == 4
    assert mgr.ensure_free(2) and mgr.radix.cached_blocks() == 4


def test_ensure_free_returns_false_without_evicting_when_impossible() -> None:
    mgr = make_manager(device=8)
    active = mgr.open_trajectory()
    turn(active, range(16))
    idle = mgr.open_trajectory()
    turn(idle, range(100, 108))
    idle.close()
    assert not mgr.ensure_free(7)
    assert mgr.radix.cached_blocks() == 6


def test_usage_counts_cached_blocks_as_used() -> None:
    mgr = make_manager(device=10)
    idle = mgr.open_trajectory()
    turn(idle, range(16))
    idle.close()
    assert mgr.usage == pytest.approx(0.4)
    mgr.radix.evict(10)
    assert mgr.usage == 0.0


def test_clock_orders_eviction() -> None:
    now = [0.0]
    mgr = KVManager(KVConfig(block_size=4, num_device_blocks=8), clock=lambda: now[0])
    for start, t in [(0, 5.0), (100, 1.0), (200, 3.0)]:
        now[0] = t
        traj = mgr.open_trajectory(tokens=range(start, start + 4))
        turn(traj, [])
        traj.close()
    now[0] = 9.0
    mgr.radix.evict(1)
    assert mgr.radix.match(range(100, 104), record=False).num_tokens == 0
    assert mgr.radix.match(range(200, 204), record=False).num_tokens == 4


def test_host_copy_is_accounted_in_the_host_pool() -> None:
    mgr = make_manager(host=8)
    traj = mgr.open_trajectory()
    turn(traj, range(8))
    node = traj.locked_node
    mgr.radix.add_copy(node, Tier.HOST, mgr.pools[Tier.HOST].allocate(2))
    mgr.check_invariants()
    traj.close()
    mgr.radix.evict(10)
    assert mgr.radix.match(range(8), record=False, tier=None).num_tokens == 8
    assert mgr.pools[Tier.HOST].num_used == 2
    mgr.radix.evict(10, Tier.HOST)
    assert mgr.pools[Tier.HOST].num_used == 0 and not node.alive
    mgr.check_invariants()


def test_check_invariants_catches_corrupted_refcount() -> None:
    mgr = make_manager()
    traj = mgr.open_trajectory()
    turn(traj, range(10))
    mgr.check_invariants()
    mgr.device._refcounts[traj.block_table[0]] += 1
    with pytest.raises(AssertionError, match="refcount"):
        mgr.check_invariants()


def test_check_invariants_catches_corrupted_lock_count() -> None:
    mgr = make_manager()
    traj = mgr.open_trajectory()
    turn(traj, range(10))
    traj.locked_node.lock_count += 1
    traj.locked_node.parent.lock_count += 1
    with pytest.raises(AssertionError, match="lock count"):
        mgr.check_invariants()


def test_check_invariants_catches_shared_prefix_that_differs_from_locked_path() -> None:
    mgr = make_manager()
    a = mgr.open_trajectory()
    turn(a, range(8))
    b = mgr.open_trajectory()
    turn(b, range(100, 108))
    a.block_table[0], b.block_table[0] = b.block_table[0], a.block_table[0]
    with pytest.raises(AssertionError, match="locked path"):
        mgr.check_invariants()


def test_fork_or_defer_forks_when_it_can() -> None:
    mgr = make_manager()
    parent = mgr.open_trajectory()
    turn(parent, range(10))
    result = mgr.fork_or_defer(parent)
    assert not result.deferred and result.copy is not None
    assert result.child.num_computed_tokens == 10
    mgr.check_invariants()


def test_fork_or_defer_defers_when_asked_or_out_of_blocks() -> None:
    mgr = make_manager(device=4)
    parent = mgr.open_trajectory()
    turn(parent, range(10))  # 3 blocks, the last one partial
    asked = mgr.fork_or_defer(parent, defer=True)
    assert asked.deferred and asked.copy is None
    assert asked.child.tokens == parent.tokens and asked.child.num_computed_tokens == 0
    assert parent.locked_tokens == 8  # the parent's full blocks were committed for the child
    assert asked.child.reuse_prefix() == 8
    taken = mgr.device.allocate(mgr.device.num_free)  # no block left for a tail copy
    short = mgr.fork_or_defer(parent)
    assert short.deferred and short.child.num_computed_tokens == 0
    mgr.device.free(taken)
    mgr.check_invariants()


def test_a_decode_runs_bad_counts_are_refused_and_change_nothing() -> None:
    """`extend_run` and `computed_in_run` (a decode run's bulk calls) refuse counts past the
    tokens or the table with a ValueError, before touching the trajectory."""
    from array import array

    traj = make_manager().open_trajectory()
    turn(traj, range(6))  # 6 tokens computed, in 2 blocks of 4
    before = (list(traj.tokens), traj.num_computed_tokens)
    with pytest.raises(ValueError, match="cannot mark"):
        traj.extend_run(array("i", [7, 8]), 9)  # 8 tokens after it, not 9
    with pytest.raises(ValueError, match="cannot mark"):
        traj.extend_run(array("i", [7, 8]), 5)  # fewer than already computed
    assert (list(traj.tokens), traj.num_computed_tokens) == before
    traj.extend_run(array("i", [7, 8]), 8)
    assert list(traj.tokens) == [*range(6), 7, 8] and traj.num_computed_tokens == 8
    with pytest.raises(ValueError):
        traj.computed_in_run(9)  # past the tokens
    traj.computed_in_run(7)
    assert traj.num_computed_tokens == 7
