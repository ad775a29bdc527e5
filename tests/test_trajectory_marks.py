"""Two figures kept where they change instead of walked or observed every step: a trajectory's
high-water mark of KV computed by steps (`Trajectory.high_water`, for recompute counts) and
the manager's count of trajectories holding blocks (`KVManager.resident_trajectories`, a
load gauge). Through random agent sessions on a pool small enough that allocations evict,
each equals what it replaced: the mark a step-by-step observer keeps (the highest count seen
after each step, capped by a rewind, dropped when forgotten), and the walk over the tables."""

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
    st.tuples(st.just("rewind"), st.integers(0, 9), st.integers(0, 40)),
    st.tuples(st.just("forget"), st.integers(0, 9), st.just(0)),
    st.tuples(st.just("close"), st.integers(0, 9), st.just(0)),
)


class Observer:
    """The high-water marks as the step loop kept them: observed after every step."""

    def __init__(self) -> None:
        self.high: dict[int, int] = {}

    def step(self, traj: Trajectory, n: int) -> None:
        traj.allocate(n)
        traj.mark_computed(n)
        if self.high.get(traj.traj_id, 0) < traj.num_computed_tokens:
            self.high[traj.traj_id] = traj.num_computed_tokens

    def rewound(self, traj: Trajectory, num_tokens: int) -> None:
        if self.high.get(traj.traj_id, 0) > num_tokens:
            self.high[traj.traj_id] = num_tokens


def resident(kv: KVManager) -> int:
    return len([t for t in kv.trajectories.values() if t.block_table])


@settings(deadline=None, max_examples=300)
@example(  # a prefix hit after a release is not computed by a step: no mark for it
    ops=[("open", 0, 6), ("turn", 0, 3), ("release", 0, 1), ("open", 0, 6), ("turn", 1, 0)],
    seed=0,
)
@example(  # a forked child released before its first step gets no mark (its parent's stays)
    ops=[("open", 0, 6), ("turn", 0, 2), ("fork", 0, 0), ("release", 1, 1), ("decode", 1, 3)],
    seed=1,
)
@example(  # a rewind caps the mark below the count computed; the next steps raise it again
    ops=[("open", 0, 9), ("turn", 0, 0), ("rewind", 0, 5), ("release", 0, 1), ("turn", 0, 1)],
    seed=2,
)
@example(  # a cut to nothing empties the table: no longer resident
    ops=[("open", 0, 2), ("turn", 0, 0), ("truncate", 0, 0), ("turn", 0, 3)],
    seed=3,
)
@given(ops=st.lists(op, max_size=50), seed=st.integers(0, 3))
def test_kept_marks_and_resident_count_match_observing_and_walking(
    ops: list[tuple[str, int, int]], seed: int
) -> None:
    kv = KVManager(KVConfig(block_size=B, num_device_blocks=24))
    observer = Observer()
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
                if len(traj.tokens) > traj.num_computed_tokens:
                    observer.step(traj, len(traj.tokens) - traj.num_computed_tokens)
                traj.commit()
            elif kind == "decode" and traj.num_computed_tokens == len(traj.tokens) < 80:
                for _ in range(n):
                    traj.append_tokens([next(fresh)])
                    observer.step(traj, 1)
                    if traj.num_computed_tokens % B == 0:
                        traj.commit()
            elif kind == "fork":
                open_.append(traj.fork().child)
            elif kind == "release":
                traj.release_kv(keep_in_cache=bool(n))
            elif kind in ("truncate", "rewind"):
                cut = min(n, len(traj.tokens))
                traj.truncate(cut)
                if kind == "rewind":  # what a session's rewind tells the offload manager
                    traj.cap_high_water(cut)
                    observer.rewound(traj, cut)
            elif kind == "forget":
                traj.forget_high_water()
                observer.high.pop(traj.traj_id, None)
            elif kind == "close":
                traj.close()
                open_.remove(traj)
        except OutOfBlocks:
            pass
        for t in open_:
            assert t.high_water() == observer.high.get(t.traj_id, 0), t
        assert kv.resident_trajectories == resident(kv)
        kv.check_invariants()
