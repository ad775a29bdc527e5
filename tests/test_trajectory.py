from __future__ import annotations

from array import array
from collections.abc import Sequence

import pytest

from kvpilot.errors import InvalidRequest, OutOfBlocks
from kvpilot.memory import KVConfig, KVManager, Tier, Trajectory


def make_manager(device: int = 32, block_size: int = 4) -> KVManager:
    return KVManager(KVConfig(block_size=block_size, num_device_blocks=device))


def compute_all(traj: Trajectory) -> None:
    todo = len(traj.tokens) - traj.num_computed_tokens
    traj.allocate(todo)
    traj.mark_computed(todo)


def run_turn(traj: Trajectory, prompt: Sequence[int], output: Sequence[int] = ()) -> int:
    """One agent turn: prompt in, prefill, decode ``output`` token by token, commit."""
    traj.append_tokens(prompt)
    cached = traj.reuse_prefix()
    compute_all(traj)
    for token in output:
        traj.append_tokens([token])
        traj.allocate(1)
        traj.mark_computed(1)
    traj.finish_turn()
    return cached


def test_fork_copies_only_partial_tail_block() -> None:
    mgr = make_manager()
    parent = mgr.open_trajectory(tokens=range(10))
    compute_all(parent)
    result = parent.fork()
    child = result.child
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != parent.block_table[2]
    assert result.copy == (parent.block_table[2], child.block_table[2])
    # The shared blocks: one reference, the tree's (both locks hold the path); the tail: the
    # parent's own.
    assert [mgr.device.refcount(b) for b in parent.block_table] == [1, 1, 1]
    assert child.num_computed_tokens == 10 and child.tokens == parent.tokens
    assert child.locked_node is parent.locked_node and parent.locked_node.lock_count == 2
    assert mgr.trajectories[child.traj_id] is child
    mgr.check_invariants()


def test_fork_of_block_aligned_trajectory_copies_nothing() -> None:
    mgr = make_manager()
    parent = mgr.open_trajectory(tokens=range(8))
    compute_all(parent)
    result = parent.fork()
    assert result.copy is None
    assert result.child.block_table == parent.block_table
    assert result.child.num_private_blocks == 0
    mgr.check_invariants()


def test_forked_child_diverges_without_touching_parent() -> None:
    mgr = make_manager()
    parent = mgr.open_trajectory(tokens=range(10))
    compute_all(parent)
    child = parent.fork().child
    before = list(parent.block_table)
    run_turn(child, [70, 71, 72, 73])
    run_turn(parent, [80, 81])
    assert parent.block_table[:3] == before
    assert child.block_table[:2] == before[:2]
    assert child.tokens[10:].tolist() == [70, 71, 72, 73]
    assert parent.tokens[10:].tolist() == [80, 81]
    mgr.check_invariants()


def test_fork_raises_out_of_blocks_without_registering_a_child() -> None:
    mgr = make_manager(device=3)
    parent = mgr.open_trajectory(tokens=range(10))
    compute_all(parent)
    with pytest.raises(OutOfBlocks):
        parent.fork()
    assert list(mgr.trajectories) == [parent.traj_id]
    mgr.check_invariants()


def test_close_releases_everything() -> None:
    mgr = make_manager()
    traj = mgr.open_trajectory()
    run_turn(traj, range(10), output=[50, 51])
    child = traj.fork().child
    run_turn(child, [60, 61, 62])
    traj.close()
    child.close()
    assert not mgr.trajectories
    assert traj.closed and traj.block_table == [] and traj.num_computed_tokens == 0
    assert mgr.device.num_used == mgr.radix.cached_blocks() == mgr.radix.evictable_blocks()
    assert all(node.lock_count == 0 for node in mgr.radix.iter_nodes())
    mgr.radix.evict(mgr.device.num_blocks)
    assert mgr.device.num_free == mgr.device.num_blocks
    mgr.check_invariants()


def test_close_is_idempotent_and_a_closed_trajectory_rejects_use() -> None:
    mgr = make_manager()
    traj = mgr.open_trajectory(tokens=range(5))
    traj.close()
    traj.close()
    with pytest.raises(InvalidRequest, match="closed"):
        traj.append_tokens([1])
    with pytest.raises(InvalidRequest, match="closed"):
        traj.reuse_prefix()
    mgr.check_invariants()


def test_release_kv_keeps_prefix_in_cache_for_recompute() -> None:
    mgr = make_manager()
    traj = mgr.open_trajectory(tokens=range(10))
    compute_all(traj)
    full_blocks = traj.block_table[:2]
    traj.release_kv()
    assert traj.block_table == [] and traj.num_computed_tokens == 0
    assert traj.tokens.tolist() == list(range(10)) and traj.locked_tokens == 0
    assert mgr.radix.evictable_blocks() == 2
    assert traj.reuse_prefix() == 8
    assert traj.block_table == full_blocks
    mgr.check_invariants()


def test_release_kv_without_keeping_in_cache_frees_private_blocks() -> None:
    mgr = make_manager()
    traj = mgr.open_trajectory(tokens=range(10))
    compute_all(traj)
    traj.release_kv(keep_in_cache=False)
    assert mgr.radix.cached_blocks() == 0
    assert mgr.device.num_free == mgr.device.num_blocks
    assert traj.reuse_prefix() == 0
    mgr.check_invariants()


def test_allocate_evicts_cached_blocks_when_pool_is_short() -> None:
    mgr = make_manager(device=8)
    done = mgr.open_trajectory()
    run_turn(done, range(24))
    done.close()
    assert mgr.radix.cached_blocks() == 6 and mgr.device.num_free == 2
    traj = mgr.open_trajectory(tokens=range(100, 116))
    traj.allocate(16)
    assert len(traj.block_table) == 4
    assert mgr.radix.cached_blocks() == 4 and mgr.device.num_free == 0
    mgr.check_invariants()


def test_out_of_blocks_has_no_side_effect() -> None:
    mgr = make_manager(device=4)
    holder = mgr.open_trajectory()
    run_turn(holder, range(12))
    traj = mgr.open_trajectory(tokens=range(100, 108))
    with pytest.raises(OutOfBlocks) as info:
        traj.allocate(8)
    assert (info.value.requested, info.value.free) == (2, 1)
    assert traj.block_table == [] and traj.num_computed_tokens == 0
    assert mgr.device.num_free == 1 and mgr.radix.cached_blocks() == 3
    mgr.check_invariants()


def test_second_turn_reuses_first_turn_blocks() -> None:
    mgr = make_manager()
    traj = mgr.open_trajectory()
    assert run_turn(traj, range(20), output=[90, 91, 92, 93, 94]) == 0
    first_turn = list(traj.block_table)
    assert run_turn(traj, range(200, 206)) == 25
    assert traj.block_table[:7] == first_turn
    assert traj.locked_tokens == 28
    mgr.check_invariants()


def test_new_trajectory_with_the_same_history_hits_committed_blocks() -> None:
    mgr = make_manager()
    first = mgr.open_trajectory()
    run_turn(first, range(20), output=[90, 91, 92])
    first.close()
    again = mgr.open_trajectory(tokens=[*range(20), 90, 91, 92, 5, 6])
    assert again.reuse_prefix() == 20
    assert again.block_table == first_blocks(mgr, list(range(20)))
    mgr.check_invariants()


def first_blocks(mgr: KVManager, tokens: list[int]) -> list[int]:
    return mgr.radix.match(tokens, record=False).blocks(Tier.DEVICE)


def test_reuse_prefix_always_leaves_one_token_to_compute() -> None:
    mgr = make_manager()
    run_turn(mgr.open_trajectory(), range(8))
    traj = mgr.open_trajectory(tokens=range(8))
    assert traj.reuse_prefix() == 4
    assert traj.blocks_needed(4) == 1


def test_reuse_prefix_replaces_private_blocks_with_cached_ones() -> None:
    mgr = make_manager(device=16)
    slow = mgr.open_trajectory(tokens=range(6))
    compute_all(slow)
    private = list(slow.block_table)
    run_turn(mgr.open_trajectory(), range(16))
    slow.append_tokens(range(6, 14))
    assert slow.reuse_prefix() == 12
    assert slow.block_table == first_blocks(mgr, list(range(12)))
    assert all(mgr.device.refcount(b) == 0 for b in private)
    mgr.check_invariants()


def test_commit_adopts_canonical_blocks_from_sibling() -> None:
    mgr = make_manager()
    a = mgr.open_trajectory(tokens=range(9))
    b = mgr.open_trajectory(tokens=range(9))
    for traj in (a, b):
        traj.reuse_prefix()
        compute_all(traj)
    b_own = b.block_table[:2]
    assert a.commit() == 2
    assert b.commit() == 0
    assert b.block_table[:2] == a.block_table[:2]
    assert all(mgr.device.refcount(x) == 0 for x in b_own)
    assert b.locked_node is a.locked_node
    mgr.check_invariants()


def test_commit_leaves_only_partial_tail_private() -> None:
    mgr = make_manager()
    traj = mgr.open_trajectory(tokens=range(10))
    compute_all(traj)
    assert traj.num_private_blocks == 3
    assert traj.commit() == 2
    assert traj.num_private_blocks == 1 and traj.locked_tokens == 8
    traj.append_tokens([1, 2])
    compute_all(traj)
    traj.commit()
    assert traj.num_private_blocks == 0 and traj.locked_tokens == 12
    mgr.check_invariants()


def test_hit_rate_per_trajectory() -> None:
    mgr = make_manager()
    run_turn(mgr.open_trajectory(), range(16))
    traj = mgr.open_trajectory()
    run_turn(traj, [*range(12), 100, 101, 102, 103])
    assert (traj.prompt_tokens_total, traj.hit_tokens_total) == (16, 12)
    run_turn(traj, [7, 7, 7, 7])
    assert (traj.prompt_tokens_total, traj.hit_tokens_total) == (36, 28)
    assert traj.hit_rate == pytest.approx(28 / 36)
    assert mgr.radix.stats.hit_tokens == 28 and mgr.radix.stats.queried_tokens == 52


def test_blocks_needed_counts_only_missing_blocks() -> None:
    mgr = make_manager()
    traj = mgr.open_trajectory(tokens=range(6))
    assert traj.blocks_needed(6) == 2
    traj.allocate(5)
    assert traj.blocks_needed(6) == 0 and traj.blocks_needed(9) == 1


def test_mark_computed_rejects_uncovered_tokens() -> None:
    mgr = make_manager()
    traj = mgr.open_trajectory(tokens=range(10))
    traj.allocate(4)
    with pytest.raises(ValueError, match="allocate first"):
        traj.mark_computed(5)
    with pytest.raises(ValueError, match="cannot mark"):
        traj.mark_computed(11)
    traj.mark_computed(4)
    assert traj.num_computed_tokens == 4


def test_direct_appends_to_tokens_are_picked_up() -> None:
    mgr = make_manager()
    run_turn(mgr.open_trajectory(), range(12))
    traj = mgr.open_trajectory(tokens=range(4))
    traj.tokens.extend(array("i", range(4, 10)))  # the int32 array matching reads
    assert traj.reuse_prefix() == 8
    mgr.check_invariants()


def test_token_ids_outside_int32_are_rejected_without_side_effect() -> None:
    mgr = make_manager()
    traj = mgr.open_trajectory(tokens=[1, 2])
    with pytest.raises(InvalidRequest, match="int32"):
        traj.append_tokens([3, 2**40])
    assert traj.tokens.tolist() == [1, 2]


def test_commits_of_a_decoding_session_grow_one_node() -> None:
    mgr = make_manager()
    traj = mgr.open_trajectory(tokens=range(6))
    traj.reuse_prefix()
    compute_all(traj)
    for token in range(40):
        traj.append_tokens([token])
        traj.allocate(1)
        traj.mark_computed(1)
        traj.commit()
    assert traj.locked_tokens == 44 and mgr.radix.num_nodes == 1
    assert traj.locked_node.num_blocks == 11
    mgr.check_invariants()


def test_commit_branches_instead_of_growing_a_node_another_trajectory_locks() -> None:
    mgr = make_manager()
    parent = mgr.open_trajectory(tokens=range(8))
    compute_all(parent)
    child = parent.fork().child
    shared = parent.locked_node
    run_turn(parent, range(100, 104))
    run_turn(child, range(200, 204))
    assert shared.depth_tokens == 8 and len(shared.children) == 2
    assert parent.locked_node.parent is shared and child.locked_node.parent is shared
    mgr.check_invariants()


def test_truncate_inside_shared_path_keeps_full_blocks_before_the_cut() -> None:
    mgr = make_manager()
    traj = mgr.open_trajectory()
    run_turn(traj, range(20), output=[100, 101, 102])
    before = list(traj.block_table)
    traj.truncate(10)  # cut inside block 2 of a committed (shared) path
    mgr.check_invariants()
    assert traj.tokens.tolist() == list(range(10))
    assert traj.num_computed_tokens == 8 and traj.block_table == before[:2]
    assert traj.locked_tokens == 8
    # The next turn reuses the two kept blocks and recomputes from the cut on.
    cached = run_turn(traj, [7, 7, 7])
    assert cached == 8
    mgr.check_invariants()


def test_truncate_beyond_the_computed_tokens_keeps_all_kv() -> None:
    mgr = make_manager()
    traj = mgr.open_trajectory()
    run_turn(traj, range(10), output=[50])
    computed = traj.num_computed_tokens
    traj.truncate(len(traj.tokens))
    assert traj.num_computed_tokens == computed
    with pytest.raises(InvalidRequest):
        traj.truncate(len(traj.tokens) + 1)
    traj.close()
    mgr.check_invariants()
