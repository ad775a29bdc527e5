"""The memory core's random agent workloads again, on a hybrid model's two layer groups.

Every operation of `MemoryMachine` (turns, forks, commits, releases, truncations by
release, evictions, tier moves) now also keeps a sliding-window group: each trajectory's
window table is checked against a model of window-group KV contents. Window KV may only be
written into a window block the trajectory holds alone (never the null block, never a cached
one), every window block a trajectory holds inside its window must carry the KV of its
tokens, and everything the memory core's `check_invariants` says of the groups must hold
(refcounts of trajectories plus cache, nulls exactly below the window, at most
ceil(W/B) + 1 window blocks of computed KV per trajectory).
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from test_memory_stateful import B, MemoryMachine, kv, small_tokens

from kvpilot.memory import ForkResult, KVConfig, KVManager, Tier, Trajectory
from kvpilot.memory.window import NULL_BLOCK


class WindowMachine(MemoryMachine):
    WINDOW = 6  # not a multiple of B: a block is partly inside the window

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVManager(
            KVConfig(
                block_size=B,
                num_device_blocks=14,
                num_host_blocks=8,
                window_tokens=self.WINDOW,
                num_window_blocks=10,
            )
        )
        self.window_kv: dict[int, dict[int, int]] = {}

    def allocate(self, traj: Trajectory, n: int) -> bool:
        assert traj.window is not None
        before = list(traj.window.blocks)
        held = self.mgr.window.pool.num_used if self.mgr.window else 0
        if not super().allocate(traj, n):
            assert traj.window.blocks == before
            assert self.mgr.window is not None and self.mgr.window.pool.num_used <= held
            return False
        for block in traj.window.blocks[len(before) :]:
            self.window_kv[block] = {}
        return True

    def compute(self, traj: Trajectory, n: int) -> None:
        assert traj.window is not None and self.mgr.window is not None
        start = traj.num_computed_tokens
        cached = set(self.mgr.window.cache.values())
        for pos in range(start, start + n):
            block = traj.window.blocks[pos // B]
            assert block != NULL_BLOCK, "window KV written into the null block"
            assert block not in cached, "window KV written into a cached block"
            assert self.mgr.window.pool.refcount(block) == 1, "window KV into a shared block"
            self.window_kv[block][pos % B] = kv(traj.tokens, pos)
        super().compute(traj, n)

    def forked(self, result: ForkResult) -> None:
        super().forked(result)
        if result.copy is not None:
            assert result.window_copy is not None
            wsrc, wdst = result.window_copy
            self.window_kv[wdst] = dict(self.window_kv[wsrc])
        else:
            assert result.window_copy is None

    @precondition(lambda self: any(j.src is Tier.DEVICE for j in self.in_flight))
    @rule(k=st.integers(0, 50), extra=small_tokens)
    def resume_while_moving_out(self, k: int, extra: list[int]) -> None:
        """As the base machine's, but a hit counts only as far as its window is cached: the
        whole moving node at least when its last window is."""
        opened = self.open_on_moving_node(k, extra)
        if opened is None:
            return
        node, traj = opened
        assert traj.window is not None
        blocks = node.depth_tokens // B
        whole = traj.window.longest_valid(blocks, 0, traj.token_array()) == blocks
        cached = traj.reuse_prefix()
        if whole:  # (if not, a deeper hit may still have its own window cached)
            assert cached >= node.depth_tokens

    @precondition(lambda self: self.mgr.trajectories)
    @rule(i=st.integers(0, 50), cut=st.integers(0, 48))
    def truncate(self, i: int, cut: int) -> None:
        traj = self.pick(i)
        traj.truncate(min(cut, len(traj.tokens)))

    @invariant()
    def window_blocks_hold_the_kv_of_their_tokens(self) -> None:
        window = self.mgr.window
        assert window is not None
        for traj in self.mgr.trajectories.values():
            table = traj.window
            assert table is not None
            p = traj.num_computed_tokens  # the next query: it reads keys p - W < k < p
            for pos in range(max(0, p - self.WINDOW + 1), p):
                block = table.blocks[pos // B]
                assert block != NULL_BLOCK, f"position {pos} is in the window of {p}"
                assert self.window_kv[block].get(pos % B) == kv(traj.tokens, pos)
            held = [b for b in table.blocks[: -(-p // B)] if b != NULL_BLOCK]
            assert len(held) <= -(-self.WINDOW // B) + 1, "more than ceil(W/B)+1 held"

    def teardown(self) -> None:
        super().teardown()
        window = self.mgr.window
        assert window is not None
        everything = window.allocate(window.pool.num_free + window.evictable_blocks())
        window.release(everything)
        assert window.pool.num_used == 1 and not window.cache  # the null block only


class AlignedWindowMachine(WindowMachine):
    WINDOW = 8  # a multiple of B


WindowMachine.TestCase.settings = MemoryMachine.TestCase.settings
AlignedWindowMachine.TestCase.settings = MemoryMachine.TestCase.settings
test_window_group_under_random_agent_workloads = WindowMachine.TestCase
test_aligned_window_group_under_random_agent_workloads = AlignedWindowMachine.TestCase
