"""`Trajectory.reuse_prefix` through `RadixCache.touch_leaf` (a session's next turn whose
locked node is a leaf: only its path's access times change) leaves exactly the state that
the full `match` it replaces leaves: the same nodes, access times, splits, blocks, locks,
statistics, clock and trajectories, whatever the workload before (shared prefixes, forks,
evictions under a small pool, rewinds, closed sessions, reuse limits)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.errors import OutOfBlocks
from kvpilot.memory import KVConfig, KVManager, RadixNode, Trajectory

B = 2
PROMPTS = [[1, 1, 2, 2, 3], [1, 1, 2, 2, 4, 4, 5], [6, 6, 7], [1, 1, 8, 8, 8, 8, 9]]

ops = st.lists(
    st.tuples(
        st.sampled_from(["open", "turn", "fork", "close", "cut", "limit"]),
        st.integers(0, 7),
        st.lists(st.integers(0, 9), max_size=5),
    ),
    max_size=14,
)


def run(script: list[tuple[str, int, list[int]]], fast: bool) -> KVManager:
    """Play ``script`` on a fresh manager; ``fast=False`` turns `touch_leaf` off (every
    `reuse_prefix` does the full match)."""
    kv = KVManager(KVConfig(block_size=B, num_device_blocks=12))
    if not fast:
        kv.radix.touch_leaf = lambda node, length: False  # type: ignore[method-assign]
    for op, i, tokens in script:
        trajs = sorted(kv.trajectories.values(), key=lambda t: t.traj_id)
        if op == "open" or not trajs:
            trajs.append(kv.open_trajectory(tokens=PROMPTS[i % len(PROMPTS)]))
        traj = trajs[i % len(trajs)]
        if op == "turn":
            turn(traj, tokens)
        elif op == "fork":
            kv.fork_or_defer(traj)
        elif op == "close":
            traj.close()
        elif op == "cut":
            traj.truncate(len(traj.tokens) * i // 8)
        elif op == "limit":
            traj.reuse_limit = None if i % 2 else i * B
    return kv


def turn(traj: Trajectory, tokens: list[int]) -> None:
    """A turn: new tokens, the prefix reused, the rest computed and committed (or released
    when the pool is short)."""
    traj.append_tokens(tokens)
    traj.reuse_prefix()
    remaining = len(traj.tokens) - traj.num_computed_tokens
    try:
        traj.allocate(remaining)
    except OutOfBlocks:
        traj.release_kv()
        return
    traj.mark_computed(remaining)
    traj.commit()


def label(node: RadixNode) -> tuple[object, ...]:
    return (
        node.path_tokens().tolist(),
        dict(node.blocks),
        node.last_access,
        node.lock_count,
        node.alive,
    )


def state(kv: KVManager) -> tuple[object, ...]:
    radix = kv.radix
    trajs = [
        (
            t.traj_id,
            t.tokens.tolist(),
            list(t.block_table),
            t.num_computed_tokens,
            t.locked_tokens,
            t.locked_node.path_tokens().tolist(),
            t.hit_tokens_total,
            t.high_water(),
        )
        for t in sorted(kv.trajectories.values(), key=lambda t: t.traj_id)
    ]
    return (
        sorted(label(node) for node in radix.iter_nodes()),
        trajs,
        radix.stats,
        list(kv.device._free),
        radix._clock(),  # the clock ticked as often
    )


@settings(max_examples=300, deadline=None)
@given(script=ops)
def test_reuse_prefix_through_touch_leaf_equals_the_full_match(
    script: list[tuple[str, int, list[int]]],
) -> None:
    fast, slow = run(script, fast=True), run(script, fast=False)
    assert state(fast) == state(slow)
    fast.check_invariants()


def test_a_next_turn_on_a_locked_leaf_touches_its_path_only() -> None:
    kv = KVManager(KVConfig(block_size=B, num_device_blocks=12))
    traj = kv.open_trajectory(tokens=[1, 1, 2, 2, 3])
    turn(traj, [])
    leaf = traj.locked_node
    assert not leaf.children and leaf.lock_count == 1
    before = leaf.last_access
    assert kv.radix.touch_leaf(leaf, len(traj.tokens))
    assert leaf.last_access > before
    assert not kv.radix.touch_leaf(leaf, leaf.depth_tokens - B)  # the path is cut: match
    other = kv.open_trajectory(tokens=[1, 1, 2, 2, 3])
    other.reuse_prefix()
    assert not kv.radix.touch_leaf(kv.radix.root(), 4)  # a root with children: match
    traj.close()
    other.close()
    assert leaf.lock_count == 0 and not leaf.children
    assert not kv.radix.touch_leaf(leaf, len(traj.tokens))  # unlocked: its copies may go
