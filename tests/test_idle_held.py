"""The idle sessions' held blocks the offload manager keeps (`IdleHeld`, re-walking only the
sessions whose last walk went stale) equal walking every idle session's path
(`held_blocks`) after any change to the tree: other trajectories taking the same tokens
(locking into an idle session's exclusive part, splitting it), the last other holder of a
shared node letting go, forks, rewinds, releases and prefix pins."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.idle_held import IdleHeld
from kvpilot.engine.pause_pricing import held_blocks
from kvpilot.errors import OutOfBlocks
from kvpilot.memory import KVConfig, KVManager, RadixNode, Trajectory
from kvpilot.sim.build import SimSetup, build_engine
from kvpilot.sim.drivers import AgentDriver
from kvpilot.sim.simulator import Simulator
from kvpilot.sim.workload import WorkloadConfig

B = 4
# Few distinct token streams, so trajectories often share (and split) each other's paths.
STEMS = [[1] * 8, [1] * 4 + [2] * 8, [3] * 12, [1] * 8 + [4] * 4]


@dataclass
class FakeSession:
    session_id: str
    traj: Trajectory


def slow_sum(sessions: list[FakeSession]) -> int:
    return sum(held_blocks(s.traj) for s in sessions)


class IdleHeldMachine(RuleBasedStateMachine):
    """Trajectories that run turns, pause, fork, rewind, release and close, under prefix
    pins; some are idle (in the tally) at any time."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVManager(KVConfig(block_size=B, num_device_blocks=40))
        self.tally = IdleHeld()
        self.sessions: dict[str, FakeSession] = {}
        self.idle: set[str] = set()
        self.pins: list[RadixNode] = []
        self.ids = 0

    def _pick(self, i: int, *, idle: bool | None = None) -> FakeSession | None:
        names = sorted(sid for sid in self.sessions if idle is None or (sid in self.idle) == idle)
        return self.sessions[names[i % len(names)]] if names else None

    def _add(self, traj: Trajectory) -> None:
        sid = f"s{self.ids}"
        self.ids += 1
        self.sessions[sid] = FakeSession(sid, traj)
        self.idle.add(sid)
        self.tally.idle(self.sessions[sid])

    @rule(stem=st.integers(0, len(STEMS) - 1))
    def open(self, stem: int) -> None:
        if len(self.sessions) < 8:
            self._add(self.kv.open_trajectory(tokens=STEMS[stem]))

    @rule(i=st.integers(0, 7), stem=st.integers(0, len(STEMS) - 1), tail=st.integers(0, 9))
    def turn(self, i: int, stem: int, tail: int) -> None:
        """A turn: busy, its prompt (often tokens another trajectory has) computed, idle."""
        session = self._pick(i)
        if session is None:
            return
        traj = session.traj
        self.idle.discard(session.session_id)
        self.tally.busy(session.session_id)
        n = len(traj.tokens)
        traj.append_tokens((STEMS[stem] * 3)[n % 4 : n % 4 + 4] + [5] * (tail % 3))
        try:
            traj.reuse_prefix()
            new = len(traj.tokens) - traj.num_computed_tokens
            traj.allocate(new)
            traj.mark_computed(new)
            traj.commit()
        except OutOfBlocks:
            traj.release_kv(keep_in_cache=False)
        self.idle.add(session.session_id)
        self.tally.idle(session)

    @rule(i=st.integers(0, 7))
    def start_turn(self, i: int) -> None:
        session = self._pick(i, idle=True)
        if session is not None:
            self.idle.discard(session.session_id)
            self.tally.busy(session.session_id)

    @rule(i=st.integers(0, 7))
    def end_turn(self, i: int) -> None:
        session = self._pick(i, idle=False)
        if session is not None:
            self.idle.add(session.session_id)
            self.tally.idle(session)

    @rule(i=st.integers(0, 7), keep=st.booleans())
    def release(self, i: int, keep: bool) -> None:
        session = self._pick(i)
        if session is not None:
            session.traj.release_kv(keep_in_cache=keep)

    @rule(i=st.integers(0, 7))
    def reload(self, i: int) -> None:
        """An idle trajectory takes its cached prefix back (as a prefetch does)."""
        session = self._pick(i)
        if session is not None:
            session.traj.reuse_prefix(record=False)

    @rule(i=st.integers(0, 7), ahead=st.integers(1, 9))
    def allocate_ahead(self, i: int, ahead: int) -> None:
        """An idle trajectory takes blocks ahead of its KV (admitted, then cut short)."""
        session = self._pick(i, idle=True)
        if session is not None:
            with contextlib.suppress(OutOfBlocks):
                session.traj.allocate(
                    len(session.traj.tokens) - session.traj.num_computed_tokens + ahead
                )

    @rule(i=st.integers(0, 7), cut=st.integers(0, 40))
    def rewind(self, i: int, cut: int) -> None:
        session = self._pick(i)
        if session is not None:
            session.traj.truncate(min(cut, len(session.traj.tokens)))

    @rule(i=st.integers(0, 7))
    def fork(self, i: int) -> None:
        session = self._pick(i)
        if session is not None and len(self.sessions) < 8:
            with contextlib.suppress(OutOfBlocks):
                self._add(self.kv.fork_or_defer(session.traj).child)

    @rule(i=st.integers(0, 7))
    def close(self, i: int) -> None:
        session = self._pick(i)
        if session is not None:
            session.traj.close()
            del self.sessions[session.session_id]
            self.idle.discard(session.session_id)
            self.tally.busy(session.session_id)

    @rule(stem=st.integers(0, len(STEMS) - 1), blocks=st.integers(1, 3))
    def pin(self, stem: int, blocks: int) -> None:
        """A prefix pin (a lock no trajectory holds) on a cached path."""
        match = self.kv.radix.match(STEMS[stem][: blocks * B], None, record=False)
        if match.num_tokens:
            self.kv.radix.lock(match.node)
            self.pins.append(match.node)

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 7))
    def unpin(self, i: int) -> None:
        self.kv.radix.unlock(self.pins.pop(i % len(self.pins)))

    @invariant()
    def tally_matches_a_walk(self) -> None:
        idle = [self.sessions[sid] for sid in sorted(self.idle)]
        assert self.tally.blocks() == slow_sum(idle)
        self.tally.check_invariants()


IdleHeldMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_idle_held_matches_walking_every_idle_session = IdleHeldMachine.TestCase


def computed(kv: KVManager, tokens: list[int], name: str = "idle") -> FakeSession:
    """A session whose ``tokens`` are computed and their full blocks committed."""
    traj = kv.open_trajectory(tokens=tokens)
    traj.reuse_prefix()
    new = len(tokens) - traj.num_computed_tokens
    traj.allocate(new)
    traj.mark_computed(new)
    traj.commit()
    return FakeSession(name, traj)


def test_a_trajectory_taking_the_same_tokens_shares_an_idle_path() -> None:
    """Another trajectory computing an idle one's tokens locks into its exclusive part (and
    splits it): the idle figure drops; when it leaves, the figure comes back."""
    kv = KVManager(KVConfig(block_size=B, num_device_blocks=20))
    tally = IdleHeld()
    idle = computed(kv, [1] * 12 + [2])
    tally.idle(idle)
    assert tally.blocks() == 4  # 3 full blocks on its own path, 1 private
    other = kv.open_trajectory(tokens=[1] * 8 + [7])
    other.reuse_prefix()  # splits the idle path after 2 blocks and locks the upper part
    assert tally.blocks() == held_blocks(idle.traj) == 2
    other.close()
    assert tally.blocks() == held_blocks(idle.traj) == 4


def test_the_last_other_holder_of_a_shared_node_letting_go() -> None:
    """An idle session sharing its path's upper part: when the other holder closes, that
    part is the idle session's alone (its figure grows with no change below it)."""
    kv = KVManager(KVConfig(block_size=B, num_device_blocks=20))
    tally = IdleHeld()
    other = computed(kv, [1] * 8 + [3] * 4, "other")
    idle = computed(kv, [1] * 8 + [2] * 4 + [2])
    tally.idle(idle)
    assert tally.blocks() == held_blocks(idle.traj) == 2  # its own block and the tail
    other.traj.close()
    assert tally.blocks() == held_blocks(idle.traj) == 4


def test_an_idle_rewind_within_the_private_tail() -> None:
    """Cutting blocks off the private tail leaves the locked path as it was."""
    kv = KVManager(KVConfig(block_size=B, num_device_blocks=20))
    tally = IdleHeld()
    idle = computed(kv, [1] * 8 + [2] * 3)
    idle.traj.allocate(6)  # blocks allocated ahead of KV (a turn cut short)
    tally.idle(idle)
    assert tally.blocks() == held_blocks(idle.traj) == 5
    idle.traj.truncate(9)
    assert idle.traj.locked_node.depth_tokens == 8
    assert tally.blocks() == held_blocks(idle.traj) == 2


def test_an_idle_trajectory_adopting_a_prefix_over_blocks_it_has() -> None:
    """A reload adopting a cached prefix over blocks the table already has (allocated, not
    computed): the table keeps its length, the lock moves, the figure changes."""
    kv = KVManager(KVConfig(block_size=B, num_device_blocks=20))
    tally = IdleHeld()
    cached = computed(kv, [1] * 12, "cached")
    idle = FakeSession("idle", kv.open_trajectory(tokens=[1] * 12 + [2]))
    idle.traj.allocate(13)  # four blocks, no KV yet (admitted, not run)
    tally.idle(idle)
    assert tally.blocks() == held_blocks(idle.traj) == 4
    idle.traj.reuse_prefix(record=False)
    assert len(idle.traj.block_table) == 4 and cached.traj.locked_node.lock_count == 2
    assert tally.blocks() == held_blocks(idle.traj) == 1


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    policy=st.sampled_from(["breakeven", "retain", "offload-host", "drop", "lru"]),
)
def test_the_engine_samples_what_walking_the_idle_sessions_gives(seed: int, policy: str) -> None:
    """In a simulated engine (forks, pauses, every policy's moves), the figure the idle
    memory-time sample reads equals walking every idle session's path."""
    wl = WorkloadConfig.from_dict(
        {
            "seed": seed,
            "arrival": {"concurrent": 12, "ramp_s": 2},
            "trajectory": {
                "turns": {"dist": "uniform", "low": 2, "high": 5},
                "task_tokens": {"dist": "lognormal", "median": 150, "sigma": 0.8, "max": 900},
                "observation_tokens": {"dist": "lognormal", "median": 60, "sigma": 1.0},
                "output_tokens": {"dist": "lognormal", "median": 40, "sigma": 0.8, "max": 300},
                "max_context_tokens": 3000,
            },
            "shared_prefix": {"system_tokens": 100, "tool_tokens": 37},
            "tools": {"t": {"weight": 1, "wait": {"dist": "lognormal", "median": 2, "sigma": 1}}},
            "branching": {"probability": 0.5, "fork_factor": 2, "branch_turns": 2},
        }
    )
    setup = SimSetup(
        model="llama-3-8b",
        node="h100",
        kv_blocks=600,
        duration_s=30.0,
        engine=EngineConfig.from_kwargs(max_num_seqs=64, max_prefill_chunk=256),
    )
    engine, _ = build_engine(setup, wl.vocab_size, policy)
    checked = 0

    def check(_now: float) -> None:
        nonlocal checked
        walked = sum(held_blocks(s.traj) for s in engine.sessions.idle())
        assert engine.offload.idle_held.blocks() == walked
        engine.check_invariants()
        checked += 1

    sim = Simulator(engine, duration_s=setup.duration_s, sample_interval_s=0.5, on_progress=check)
    sim.run(AgentDriver(wl, engine.max_model_len))
    assert checked > 0


def test_the_logs_stay_bounded_when_no_sample_reads_them() -> None:
    """Pins churning on an idle session's path while turns come and go, with no sample: the
    logs are worked off as they grow, and the next sample is still exact."""
    kv = KVManager(KVConfig(block_size=B, num_device_blocks=20))
    tally = IdleHeld()
    idle = computed(kv, [1] * 12 + [2])
    tally.idle(idle)
    other = computed(kv, [3] * 8, "other")
    node = idle.traj.locked_node
    for _ in range(500):
        kv.radix.lock(node)  # 1 -> 2 and back: two log entries each time
        kv.radix.unlock(node)
        tally.idle(other)
        tally.busy(other.session_id)
        assert len(tally._node_log) + len(tally._traj_log) <= 4 * 2 + 256 + 3
    assert tally.blocks() == held_blocks(idle.traj) == 4
    tally.check_invariants()


def test_with_no_idle_session_nothing_is_logged() -> None:
    """The last idle session leaving stops the radix's log (locks churn on, nobody reads)."""
    kv = KVManager(KVConfig(block_size=B, num_device_blocks=20))
    tally = IdleHeld()
    idle = computed(kv, [1] * 12 + [2])
    tally.idle(idle)
    tally.busy(idle.session_id)
    node = idle.traj.locked_node
    for _ in range(10):
        kv.radix.lock(node)
        kv.radix.unlock(node)
    assert not tally._node_log and not tally._traj_log
    tally.idle(idle)  # watched again
    assert tally.blocks() == held_blocks(idle.traj) == 4
    tally.check_invariants()


def test_one_tally_watches_one_radix_cache() -> None:
    kv, elsewhere = (KVManager(KVConfig(block_size=B, num_device_blocks=20)) for _ in range(2))
    tally = IdleHeld()
    tally.idle(computed(kv, [1] * 8))
    with pytest.raises(ValueError, match="one radix cache"):
        tally.idle(computed(elsewhere, [1] * 8, "elsewhere"))
    with pytest.raises(ValueError, match="already watched"):
        IdleHeld().idle(computed(kv, [2] * 8, "second"))
