"""Random agent sessions on one trajectory manager, for the hypothesis tests that hold a
maintained figure to the slow computation it replaced (`test_trajectory_counts`,
`test_trajectory_marks`): opens on two shared heads, turns that reuse a cached prefix,
decodes that commit block by block as decode runs do, forks, releases, truncations, rewinds,
forgotten marks and closes, on a pool small enough that allocations evict."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hypothesis import strategies as st

from kvpilot.errors import OutOfBlocks
from kvpilot.memory import KVConfig, KVManager, Trajectory

B = 4

Op = tuple[str, int, int]

_OPS = {
    "open": st.tuples(st.just("open"), st.integers(0, 3), st.integers(0, 12)),
    "turn": st.tuples(st.just("turn"), st.integers(0, 9), st.integers(0, 12)),
    "decode": st.tuples(st.just("decode"), st.integers(0, 9), st.integers(1, 3 * B)),
    "fork": st.tuples(st.just("fork"), st.integers(0, 9), st.just(0)),
    "release": st.tuples(st.just("release"), st.integers(0, 9), st.integers(0, 1)),
    "truncate": st.tuples(st.just("truncate"), st.integers(0, 9), st.integers(0, 40)),
    "rewind": st.tuples(st.just("rewind"), st.integers(0, 9), st.integers(0, 40)),
    "forget": st.tuples(st.just("forget"), st.integers(0, 9), st.just(0)),
    "close": st.tuples(st.just("close"), st.integers(0, 9), st.just(0)),
}


def ops(*kinds: str) -> st.SearchStrategy[Op]:
    """One operation of the given kinds."""
    return st.one_of(*(_OPS[kind] for kind in kinds))


def compute(traj: Trajectory, n: int) -> None:
    """What a step does to a trajectory: ``n`` more tokens computed into its blocks."""
    traj.allocate(n)
    traj.mark_computed(n)


def play(
    ops: Sequence[Op],
    seed: int,
    check: Callable[[KVManager, list[Trajectory]], None],
    *,
    step: Callable[[Trajectory, int], None] = compute,
    rewound: Callable[[Trajectory, int], None] | None = None,
    forgot: Callable[[Trajectory], None] | None = None,
) -> None:
    """Carry out ``ops`` on a fresh manager, calling ``step`` for each step's tokens (a turn's
    prefill, each decode) and ``check`` after every operation; ``rewound``/``forgot`` hear of
    the rewinds and forgotten marks (what a session tells the offload manager)."""
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
                step(traj, len(traj.tokens) - traj.num_computed_tokens)
                traj.commit()
            elif kind == "decode" and traj.num_computed_tokens == len(traj.tokens) < 80:
                for _ in range(n):  # as decode runs: allocate at a block start, commit at its end
                    traj.append_tokens([next(fresh)])
                    step(traj, 1)
                    if traj.num_computed_tokens % B == 0:
                        traj.commit()
            elif kind == "fork":
                open_.append(traj.fork().child)
            elif kind == "release":
                traj.release_kv(keep_in_cache=bool(n))
            elif kind in ("truncate", "rewind"):
                cut = min(n, len(traj.tokens))
                traj.truncate(cut)
                if kind == "rewind":
                    traj.cap_high_water(cut)
                    if rewound is not None:
                        rewound(traj, cut)
            elif kind == "forget":
                traj.forget_high_water()
                if forgot is not None:
                    forgot(traj)
            elif kind == "close":
                traj.close()
                open_.remove(traj)
        except OutOfBlocks:
            pass
        check(kv, open_)
        kv.check_invariants()
