"""Random agent workloads against the memory core, checked against a model of KV contents.

Every block carries simulated KV: position p of a sequence holds ``kv(tokens[:p+1])``. A
write must only ever land in a block its trajectory holds privately (copy-on-write), and
every block a trajectory or the radix reads must hold exactly the KV of its tokens.

Tier moves run through the `TierResidency` as the engine's tier mover drives it: a move to
host pins and move-locks, and finishes (or fails) later, after any number of other
operations (matches that split nodes, evictions, closes); a load back to the device pins
its blocks likewise. Whatever happens meanwhile, the KV of every copy must stay right.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpilot.errors import OutOfBlocks
from kvpilot.memory import ForkResult, KVConfig, KVManager, RadixNode, Tier, Trajectory

B = 4
MAX_TOKENS = 48
PROMPTS = [[9, 9, 9, 9, 8, 8, 8, 8], [9, 9, 9, 9, 7, 7], []]
small_tokens = st.lists(st.integers(0, 2), max_size=10)


def kv(tokens: list[int], pos: int) -> int:
    return hash(tuple(tokens[: pos + 1]))


@dataclass
class InFlight:
    """A copy between tiers: ``mapping`` from source block to destination block (to disk:
    the device blocks being written, mapped to themselves)."""

    src: Tier
    dst: Tier
    nodes: list[RadixNode]
    mapping: dict[int, int] = field(default_factory=dict)

    def pins(self) -> list[tuple[Tier, int]]:
        src = [(self.src, b) for b in self.mapping]
        if self.dst is Tier.DISK:
            return src
        return src + [(self.dst, b) for b in self.mapping.values()]


def path_tokens(node: RadixNode) -> list[int]:
    parts = []
    while node.parent is not None:
        parts.append(list(node.tokens))
        node = node.parent
    return [t for part in reversed(parts) for t in part]


class TierMachine(RuleBasedStateMachine):
    """Agents that work, pause to host, come back (during the move, or after), and leave."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVManager(KVConfig(block_size=B, num_device_blocks=14, num_host_blocks=8))
        self.closed: list[Trajectory] = []
        self.device_kv: dict[int, dict[int, int]] = {}
        self.host_kv: dict[int, dict[int, int]] = {}
        self.in_flight: list[InFlight] = []

    def store(self, tier: Tier) -> dict[int, dict[int, int]]:
        return self.device_kv if tier is Tier.DEVICE else self.host_kv

    # ---- helpers -------------------------------------------------------------------------

    def pick(self, i: int) -> Trajectory:
        trajs = sorted(self.mgr.trajectories.values(), key=lambda t: t.traj_id)
        return trajs[i % len(trajs)]

    def nodes(self) -> list[RadixNode]:
        return sorted(
            (n for n in self.mgr.radix.iter_nodes() if not n.is_root),
            key=lambda n: (n.depth_tokens, path_tokens(n)),
        )

    def allocate(self, traj: Trajectory, n: int) -> bool:
        before = list(traj.block_table)
        computed = traj.num_computed_tokens
        try:
            traj.allocate(n)
        except OutOfBlocks:
            assert traj.block_table == before and traj.num_computed_tokens == computed
            return False
        assert traj.block_table[: len(before)] == before
        for block in traj.block_table[len(before) :]:
            self.device_kv[block] = {}
        return True

    def compute(self, traj: Trajectory, n: int) -> None:
        indexed = {b for node in self.nodes() for b in node.blocks.get(Tier.DEVICE, ())}
        start = traj.num_computed_tokens
        traj.mark_computed(n)
        for pos in range(start, start + n):
            block = traj.block_table[pos // B]
            assert block not in indexed, "KV written into a block the radix shares"
            assert self.mgr.device.refcount(block) == 1, "KV written into a shared block"
            self.device_kv[block][pos % B] = kv(traj.tokens, pos)

    # ---- rules ---------------------------------------------------------------------------

    @rule(
        salt=st.sampled_from([None, "a", "b"]), prompt=st.sampled_from(PROMPTS), extra=small_tokens
    )
    def open(self, salt: str | None, prompt: list[int], extra: list[int]) -> None:
        self.mgr.open_trajectory(salt, [*prompt, *extra])

    @precondition(lambda self: self.mgr.trajectories)
    @rule(i=st.integers(0, 50), new=small_tokens, decode=st.integers(0, 6))
    def turn(self, i: int, new: list[int], decode: int) -> None:
        traj = self.pick(i)
        if len(traj.tokens) + len(new) + decode > MAX_TOKENS:
            return
        traj.append_tokens(new)
        cached = traj.reuse_prefix()
        assert cached == traj.num_computed_tokens <= len(traj.tokens)
        todo = len(traj.tokens) - traj.num_computed_tokens
        if not self.allocate(traj, todo):
            return
        self.compute(traj, todo)
        for token in range(decode):
            traj.append_tokens([token % 3])
            if not self.allocate(traj, 1):
                return
            self.compute(traj, 1)

    @precondition(lambda self: self.mgr.trajectories)
    @rule(i=st.integers(0, 50))
    def close(self, i: int) -> None:
        traj = self.pick(i)
        traj.close()
        self.closed.append(traj)

    @rule(n=st.integers(1, 12), tier=st.sampled_from([Tier.DEVICE, Tier.HOST]))
    def evict(self, n: int, tier: Tier) -> None:
        evictable = self.mgr.radix.evictable_blocks(tier)
        freed = self.mgr.radix.evict(n, tier)
        if not self.mgr.residency.pins[tier]:  # a pinned block outlives its eviction
            assert freed >= min(n, evictable)

    @precondition(lambda self: self.mgr.trajectories)
    @rule(i=st.integers(0, 50))
    def pause_to_host(self, i: int) -> None:
        """As the offload manager's OFFLOAD_HOST: release the trajectory's KV to the cache, then
        `TierMover.swap_out` its exclusive nodes: pin both ends, move-lock, copy off the loop."""
        traj = self.pick(i)
        traj.commit()  # a turn ends committed
        residency = self.mgr.residency
        nodes = [n for n in residency.exclusive_nodes(traj) if Tier.DEVICE in n.blocks]
        traj.release_kv(keep_in_cache=True)
        mapping: dict[int, int] = {}
        chosen = []
        for node in nodes:
            dev = node.blocks.get(Tier.DEVICE)
            if not node.alive or not dev or Tier.HOST in node.blocks or node.lock_count:
                continue
            host = residency.allocate_pinned(Tier.HOST, len(dev))
            if host is None:
                break
            residency.pin(Tier.DEVICE, dev)
            mapping.update(zip(dev, host, strict=True))
            chosen.append(node)
        if chosen:
            residency.lock_for_move(chosen)
            self.in_flight.append(InFlight(Tier.DEVICE, Tier.HOST, chosen, mapping))

    @precondition(lambda self: self.mgr.trajectories)
    @rule(i=st.integers(0, 50))
    def pause_to_disk(self, i: int) -> None:
        """As OFFLOAD_DISK: `TierMover.write_disk` pins and move-locks the exclusive nodes."""
        traj = self.pick(i)
        traj.commit()
        residency = self.mgr.residency
        nodes = [n for n in residency.exclusive_nodes(traj) if Tier.DEVICE in n.blocks]
        traj.release_kv(keep_in_cache=True)
        chosen = [n for n in nodes if n.alive and n.lock_count == 0]
        ids = [b for n in chosen for b in n.blocks[Tier.DEVICE]]
        if chosen:
            residency.pin(Tier.DEVICE, ids)
            residency.lock_for_move(chosen)
            self.in_flight.append(InFlight(Tier.DEVICE, Tier.DISK, chosen, {b: b for b in ids}))

    @precondition(lambda self: any(j.src is Tier.DEVICE for j in self.in_flight))
    @rule(k=st.integers(0, 50), extra=small_tokens)
    def resume_while_moving_out(self, k: int, extra: list[int]) -> None:
        """The agent is back before its KV has left: a trajectory locks a moving node."""
        opened = self.open_on_moving_node(k, extra)
        if opened is not None:
            node, traj = opened
            assert traj.reuse_prefix() >= node.depth_tokens

    def open_on_moving_node(self, k: int, extra: list[int]) -> tuple[RadixNode, Trajectory] | None:
        """A trajectory whose tokens run through a node being moved off the device (the
        ``k``-th), then ``extra``; None when nothing moves."""
        moving = [n for j in self.in_flight if j.src is Tier.DEVICE for n in j.nodes if n.alive]
        if not moving:
            return None
        node = moving[k % len(moving)]
        root = node
        while root.parent is not None:
            root = root.parent
        salt = next(s for s, r in self.mgr.radix.roots().items() if r is root)
        return node, self.mgr.open_trajectory(salt, [*path_tokens(node), *extra, 1])

    @rule(j=st.integers(0, 50))
    def start_load_to_device(self, j: int) -> None:
        """As `TierLoader.ensure_resident`: device blocks pinned for a node's host copy."""
        residency = self.mgr.residency
        nodes = [n for n in self.nodes() if Tier.HOST in n.blocks and Tier.DEVICE not in n.blocks]
        if not nodes:
            return
        node = nodes[j % len(nodes)]
        host = node.blocks[Tier.HOST]
        dev = residency.allocate_pinned(Tier.DEVICE, len(host))
        if dev is None:
            return
        residency.pin(Tier.HOST, host)
        self.in_flight.append(
            InFlight(Tier.HOST, Tier.DEVICE, [node], dict(zip(host, dev, strict=True)))
        )

    @precondition(lambda self: self.in_flight)
    @rule(
        k=st.integers(0, 50),
        fail=st.sampled_from([False, False, False, True]),
        lost=st.sets(st.integers(0, 13)),
    )
    def finish_copy(self, k: int, fail: bool, lost: set[int]) -> None:
        self.finish(self.in_flight.pop(k % len(self.in_flight)), fail, lost)

    def finish(self, job: InFlight, fail: bool, lost: Collection[int] = ()) -> None:
        residency = self.mgr.residency
        if job.src is Tier.DEVICE:
            residency.unlock_move(job.nodes)
        if job.dst is Tier.DISK:  # some writes may fail: only what was written may go
            written = set() if fail else set(job.mapping) - set(lost)
            before: dict[RadixNode, list[int]] = {}
            for bottom in job.nodes:
                node = bottom
                while node.parent is not None and node.alive:
                    before[node] = list(node.blocks.get(Tier.DEVICE, ()))
                    node = node.parent
            for bottom in job.nodes:
                residency.drop_moved_path(bottom, written)
            for node, dev in before.items():
                if dev and (not node.alive or Tier.DEVICE not in node.blocks):
                    assert set(dev) <= written, "a device copy went that was not written"
            residency.unpin(Tier.DEVICE, list(job.mapping))
            return
        if fail:  # a failed copy: everything stays where it was
            residency.unpin(job.dst, list(job.mapping.values()))
            residency.unpin(job.src, list(job.mapping))
            return
        src, dst = self.store(job.src), self.store(job.dst)
        for a, b in job.mapping.items():
            dst[b] = dict(src[a])  # the copy (its source was pinned all along)
        used: set[int] = set()
        for node in job.nodes:
            attached, got = residency.attach(node, job.src, job.dst, job.mapping)
            used |= got
            if job.dst is Tier.HOST:
                residency.drop_device_copies(attached)
        for b in job.mapping.values():
            residency.unpin(job.dst, [b], drop_reference=b not in used)
        residency.unpin(job.src, list(job.mapping))

    # ---- checks --------------------------------------------------------------------------

    @invariant()
    def structures_are_consistent(self) -> None:
        self.mgr.check_invariants()
        for traj in self.closed:
            assert traj.closed and not traj.block_table and traj.num_computed_tokens == 0

    @invariant()
    def pins_and_move_locks_are_the_copies_in_flight(self) -> None:
        residency = self.mgr.residency
        held: dict[tuple[Tier, int], int] = {}
        for job in self.in_flight:
            for key in job.pins():
                held[key] = held.get(key, 0) + 1
        assert {(t, b): n for t, b, n in residency.pinned()} == held
        locks: dict[RadixNode, int] = {}
        for job in self.in_flight:
            if job.src is Tier.DEVICE:
                for node in job.nodes:
                    locks[node] = locks.get(node, 0) + 1
        assert dict(residency.move_locks) == locks

    @invariant()
    def trajectories_read_the_kv_of_their_tokens(self) -> None:
        for traj in self.mgr.trajectories.values():
            for pos in range(traj.num_computed_tokens):
                block = traj.block_table[pos // B]
                assert self.device_kv[block].get(pos % B) == kv(traj.tokens, pos)

    @invariant()
    def radix_blocks_hold_the_kv_of_their_path(self) -> None:
        for node in self.nodes():
            tokens = path_tokens(node)
            first = node.depth_tokens - len(node.tokens)
            for tier, store in ((Tier.DEVICE, self.device_kv), (Tier.HOST, self.host_kv)):
                for i, block in enumerate(node.blocks.get(tier, ())):
                    for off in range(B):
                        pos = first + i * B + off
                        assert store[block].get(off) == kv(tokens, pos)

    @invariant()
    def shared_prefix_is_what_the_radix_returns(self) -> None:
        radix = self.mgr.radix
        for traj in self.mgr.trajectories.values():
            locked = traj.locked_tokens
            match = radix.match(traj.tokens[:locked], traj.salt, record=False)
            assert match.num_tokens == locked
            assert match.blocks() == traj.block_table[: locked // B]

    def teardown(self) -> None:
        while self.in_flight:
            self.finish(self.in_flight.pop(), fail=False)
        self.mgr.check_invariants()
        for traj in list(self.mgr.trajectories.values()):
            traj.close()
        self.mgr.check_invariants()
        for tier in (Tier.DEVICE, Tier.HOST):
            self.mgr.radix.evict(10**6, tier)
        assert self.mgr.radix.num_nodes == 0
        for pool in self.mgr.pools.values():
            assert pool.num_free == pool.num_blocks
        self.mgr.check_invariants()


class MemoryMachine(TierMachine):
    """Every operation of the memory core, tier moves included."""

    @precondition(lambda self: self.mgr.trajectories)
    @rule(i=st.integers(0, 50))
    def commit(self, i: int) -> None:
        traj = self.pick(i)
        traj.commit()
        assert traj.num_private_blocks <= (1 if traj.num_computed_tokens % B else 0) + (
            len(traj.block_table) - -(-traj.num_computed_tokens // B)
        )

    @precondition(lambda self: self.mgr.trajectories)
    @rule(i=st.integers(0, 50))
    def fork(self, i: int) -> None:
        parent = self.pick(i)
        before = set(self.mgr.trajectories)
        try:
            result = parent.fork()
        except OutOfBlocks:
            assert set(self.mgr.trajectories) == before
            return
        self.forked(result)

    def forked(self, result: ForkResult) -> None:
        """Mirror a fork's copy of the partial last block (subclasses add their groups')."""
        if result.copy is not None:
            src, dst = result.copy
            self.device_kv[dst] = dict(self.device_kv[src])
            assert result.child.num_computed_tokens % B != 0
        else:
            assert result.child.num_computed_tokens % B == 0

    @precondition(lambda self: self.mgr.trajectories)
    @rule(i=st.integers(0, 50), keep=st.booleans())
    def release_kv(self, i: int, keep: bool) -> None:
        traj = self.pick(i)
        traj.release_kv(keep_in_cache=keep)
        assert traj.block_table == [] and traj.num_computed_tokens == 0

    @rule(j=st.integers(0, 50))
    def add_copy_to_host(self, j: int) -> None:
        nodes = [n for n in self.nodes() if Tier.DEVICE in n.blocks and Tier.HOST not in n.blocks]
        host = self.mgr.pools[Tier.HOST]
        if not nodes or not host.can_allocate(nodes[j % len(nodes)].num_blocks):
            return
        node = nodes[j % len(nodes)]
        blocks = host.allocate(node.num_blocks)
        for src, dst in zip(node.blocks[Tier.DEVICE], blocks, strict=True):
            self.host_kv[dst] = dict(self.device_kv[src])
        self.mgr.radix.add_copy(node, Tier.HOST, blocks)

    @rule(j=st.integers(0, 50), tier=st.sampled_from([Tier.DEVICE, Tier.HOST]))
    def drop_copy(self, j: int, tier: Tier) -> None:
        nodes = [n for n in self.nodes() if tier in n.blocks]
        if not nodes:
            return
        node = nodes[j % len(nodes)]
        if tier is Tier.DEVICE and node.lock_count:
            try:
                self.mgr.radix.drop_copy(node, tier)
            except ValueError:
                return
            raise AssertionError("dropped the device copy of a locked node")
        self.mgr.radix.drop_copy(node, tier)

    @precondition(lambda self: self.mgr.trajectories)
    @rule(i=st.integers(0, 50))
    def match_in_any_tier(self, i: int) -> None:
        traj = self.pick(i)
        radix = self.mgr.radix
        on_device = radix.match(traj.tokens, traj.salt, record=False)
        anywhere = radix.match(traj.tokens, traj.salt, record=False, tier=None)
        assert anywhere.num_tokens >= on_device.num_tokens
        residency = anywhere.residency()
        assert len(residency) == anywhere.num_tokens // B and all(residency)
        assert all(Tier.DEVICE in r for r in residency[: on_device.num_tokens // B])


MemoryMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_memory_core_under_random_agent_workloads = MemoryMachine.TestCase
TierMachine.TestCase.settings = MemoryMachine.TestCase.settings
test_tier_moves_under_agents_that_pause_and_return = TierMachine.TestCase


def test_a_failed_deeper_disk_write_keeps_the_device_copies_above_it() -> None:
    """Found by the machines: a pause to disk whose leaf write failed dropped the device copy
    of the node above it (written), and with it the leaf's unwritten one."""
    m = MemoryMachine()
    m.open(salt=None, prompt=[9, 9, 9, 9, 7, 7], extra=[0] * 6)
    m.turn(i=0, new=[0], decode=3)
    m.commit(i=0)
    m.turn(i=0, new=[], decode=0)
    m.pause_to_disk(i=0)
    m.commit(i=0)
    m.finish_copy(k=0, fail=False, lost={3})  # the leaf's block
    m.structures_are_consistent()
    m.teardown()
