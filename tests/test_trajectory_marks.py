"""Two figures kept where they change instead of walked or observed every step: a trajectory's
high-water mark of KV computed by steps (`Trajectory.high_water`, for recompute counts) and
the manager's count of trajectories holding blocks (`KVManager.resident_trajectories`, a
load gauge). Through random agent sessions on a pool small enough that allocations evict,
each equals what it replaced: the mark a step-by-step observer keeps (the highest count seen
after each step, capped by a rewind, dropped when forgotten), and the walk over the tables."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st
from trajectory_script import Op, compute, ops, play

from kvpilot.memory import KVManager, Trajectory

op = ops("open", "turn", "decode", "fork", "release", "truncate", "rewind", "forget", "close")


class Observer:
    """The high-water marks as the step loop kept them: observed after every step."""

    def __init__(self) -> None:
        self.high: dict[int, int] = {}

    def step(self, traj: Trajectory, n: int) -> None:
        if not n:  # nothing left to compute (a prefix hit covered it): no step runs
            return
        compute(traj, n)
        if self.high.get(traj.traj_id, 0) < traj.num_computed_tokens:
            self.high[traj.traj_id] = traj.num_computed_tokens

    def rewound(self, traj: Trajectory, num_tokens: int) -> None:
        if self.high.get(traj.traj_id, 0) > num_tokens:
            self.high[traj.traj_id] = num_tokens

    def forgot(self, traj: Trajectory) -> None:
        self.high.pop(traj.traj_id, None)

    def check(self, kv: KVManager, open_: list[Trajectory]) -> None:
        for t in open_:
            assert t.high_water() == self.high.get(t.traj_id, 0), t
        assert kv.resident_trajectories == resident(kv)


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
    ops: list[Op], seed: int
) -> None:
    observer = Observer()
    play(
        ops,
        seed,
        observer.check,
        step=observer.step,
        rewound=observer.rewound,
        forgot=observer.forgot,
    )
