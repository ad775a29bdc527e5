"""A trajectory's maintained counts (``locked_tokens``, ``num_private_blocks``) equal what its
locked node and block table say, through random agent sessions on a pool small enough that
allocations evict: decode runs that commit block by block (the leaf grows in place), turns
that reuse a cached prefix, forks, releases, truncations and closes."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpilot.errors import OutOfBlocks
from kvpilot.memory import KVConfig, KVManager, Trajectory

B = 4

op = st.one_of(
    st.tuples(st.just("open"), st.integers(0, 3), st.integers(0, 12)),
    st.tuples(st.just("turn"), st.integers(0, 9), st.integers(0, 12)),
    st.tuples(st.just("decode"), st.integers(0, 9), st.integers(1, 3 * B)),
    st.tuples(st.just("fork"), st.integers(0, 9), st.just(0)),
    st.tuples(st.just("release"), st.integers(0, 9), st.integers(0, 1)),
    st.tuples(st.just("truncate"), st.integers(0, 9), st.integers(0, 40)),
    st.tuples(st.just("close"), st.integers(0, 9), st.just(0)),
)


def slow_counts(traj: Trajectory) -> tuple[int, int]:
    depth = traj.locked_node.depth_tokens
    return depth, len(traj.block_table) - depth // B


def compute(traj: Trajectory, n: int) -> None:
    traj.allocate(n)
    traj.mark_computed(n)


@settings(deadline=None, max_examples=300)
@example(  # a turn after a release adopts the cached prefix into an empty table
    ops=[("open", 0, 4), ("turn", 0, 4), ("release", 0, 1), ("turn", 0, 3)], seed=0
)
@example(  # a forked child decodes into its own leaf; the parent's path is shared
    ops=[("open", 0, 6), ("turn", 0, 2), ("fork", 0, 0), ("decode", 1, 9), ("decode", 0, 5)],
    seed=1,
)
@given(ops=st.lists(op, max_size=50), seed=st.integers(0, 3))
def test_maintained_counts_match_the_locked_node_and_table(
    ops: list[tuple[str, int, int]], seed: int
) -> None:
    kv = KVManager(KVConfig(block_size=B, num_device_blocks=24))
    heads = [[seed, 1, 2, 3, 4, 5, 6, 7], [9, 9, 9, 9, 1, 1]]
    open_: list[Trajectory] = []
    fresh = iter(range(100, 10_000))
    for kind, i, n in ops:
        traj = open_[i % len(open_)] if open_ else None
        try:
            if kind == "open" or traj is None:
                tokens = [*heads[i % 2], *[next(fresh) for _ in range(n)]]
                open_.append(kv.open_trajectory(None, tokens))
            elif kind == "turn" and len(traj.tokens) + n < 80:
                traj.append_tokens([next(fresh) for _ in range(n)])
                traj.reuse_prefix()
                compute(traj, len(traj.tokens) - traj.num_computed_tokens)
                traj.commit()
            elif kind == "decode" and traj.num_computed_tokens == len(traj.tokens) < 80:
                for _ in range(n):  # as decode runs: allocate at a block start, commit at its end
                    traj.append_tokens([next(fresh)])
                    compute(traj, 1)
                    if traj.num_computed_tokens % B == 0:
                        traj.commit()
            elif kind == "fork":
                open_.append(traj.fork().child)
            elif kind == "release":
                traj.release_kv(keep_in_cache=bool(n))
            elif kind == "truncate":
                traj.truncate(min(n, len(traj.tokens)))
            elif kind == "close":
                traj.close()
                open_.remove(traj)
        except OutOfBlocks:
            pass
        for t in open_:
            assert (t.locked_tokens, t.num_private_blocks) == slow_counts(t)
        kv.check_invariants()
