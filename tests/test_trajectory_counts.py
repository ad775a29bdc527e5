"""A trajectory's maintained counts (``locked_tokens``, ``num_private_blocks``) equal what its
locked node and block table say, through random agent sessions on a pool small enough that
allocations evict: decode runs that commit block by block (the leaf grows in place), turns
that reuse a cached prefix, forks, releases, truncations and closes."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st
from trajectory_script import B, Op, ops, play

from kvpilot.memory import KVManager, Trajectory

op = ops("open", "turn", "decode", "fork", "release", "truncate", "close")


def slow_counts(traj: Trajectory) -> tuple[int, int]:
    depth = traj.locked_node.depth_tokens
    return depth, len(traj.block_table) - depth // B


def check(kv: KVManager, open_: list[Trajectory]) -> None:
    for t in open_:
        assert (t.locked_tokens, t.num_private_blocks) == slow_counts(t)


@settings(deadline=None, max_examples=300)
@example(  # a turn after a release adopts the cached prefix into an empty table
    ops=[("open", 0, 4), ("turn", 0, 4), ("release", 0, 1), ("turn", 0, 3)], seed=0
)
@example(  # a forked child decodes into its own leaf; the parent's path is shared
    ops=[("open", 0, 6), ("turn", 0, 2), ("fork", 0, 0), ("decode", 1, 9), ("decode", 0, 5)],
    seed=1,
)
@given(ops=st.lists(op, max_size=50), seed=st.integers(0, 3))
def test_maintained_counts_match_the_locked_node_and_table(ops: list[Op], seed: int) -> None:
    play(ops, seed, check)
