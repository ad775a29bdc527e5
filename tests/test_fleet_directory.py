"""The fleet's KV events and prefix directory against the radix cache they describe."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpilot.errors import ConfigError
from kvpilot.fleet import KeySpace, KVEventLog, PrefixDirectory, PromptKeyCache, TierMatch
from kvpilot.memory import BlockPool, RadixCache, Tier
from kvpilot.memory.hashing import HASH_BYTES

BS = 4


def make_cache(device: int = 48, host: int = 32) -> RadixCache:
    pools = {Tier.DEVICE: BlockPool(device), Tier.HOST: BlockPool(host, Tier.HOST)}
    return RadixCache(BS, pools)


def put(cache: RadixCache, tokens: list[int], salt: str | None = None) -> None:
    pool = cache.pools[Tier.DEVICE]
    n = len(tokens) // BS
    cache.evict(max(0, n - pool.num_free))
    blocks = pool.allocate(n)
    cache.insert(tokens[: n * BS], blocks, salt)
    pool.free(blocks)


def truth(cache: RadixCache) -> dict[Tier, set[bytes]]:
    """What the radix indexes, per tier, by chained hash."""
    out: dict[Tier, set[bytes]] = {tier: set() for tier in Tier}
    for node in cache.iter_nodes():
        if node.is_root:
            continue
        keys = {node.hashes[i : i + HASH_BYTES] for i in range(0, len(node.hashes), HASH_BYTES)}
        for tier in node.blocks:
            out[tier] |= keys
    return out


def directory_view(directory: PrefixDirectory, cache: RadixCache, name: str) -> dict[Tier, bool]:
    """Does the directory hold exactly the radix's blocks for ``name``, tier by tier?"""
    expected = truth(cache)
    return {tier: directory.num_blocks(name, tier) == len(expected[tier]) for tier in Tier}


class DirectoryFollowsRadix(RuleBasedStateMachine):
    """Random commits, evictions and tier moves; events applied in order keep the directory
    equal to what the radix holds, and equal to a fresh snapshot."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = make_cache()
        self.log = KVEventLog(self.cache, capacity=1 << 16)
        self.directory = PrefixDirectory(KeySpace(BS).key_space_id)
        self.directory.add_replica("r0")
        self.directory.load_snapshot("r0", self.log.snapshot(KeySpace(BS).key_space_id))
        self.prompts: list[list[int]] = []

    @rule(
        base=st.sampled_from([0, 100, 200]),
        extra=st.lists(st.integers(1, 5), min_size=1, max_size=40),
        salt=st.sampled_from([None, "t1"]),
    )
    def commit(self, base: int, extra: list[int], salt: str | None) -> None:
        tokens = [base + i for i in range(8)] + extra
        put(self.cache, tokens, salt)
        self.prompts.append(tokens)

    @rule(n=st.integers(1, 10), tier=st.sampled_from([Tier.DEVICE, Tier.HOST]))
    def evict(self, n: int, tier: Tier) -> None:
        self.cache.evict(n, tier)

    @rule(pick=st.integers(0, 1000))
    def copy_to_host(self, pick: int) -> None:
        nodes = [
            n
            for n in self.cache.iter_nodes()
            if not n.is_root and Tier.HOST not in n.blocks and n.num_blocks
        ]
        if not nodes:
            return
        node = nodes[pick % len(nodes)]
        pool = self.cache.pools[Tier.HOST]
        if pool.num_free < node.num_blocks:
            self.cache.evict(node.num_blocks - pool.num_free, Tier.HOST)
        if pool.num_free < node.num_blocks or not node.alive:
            return
        self.cache.add_copy(node, Tier.HOST, pool.allocate(node.num_blocks))  # the radix's ref

    @rule(pick=st.integers(0, 1000))
    def drop_device_copy(self, pick: int) -> None:
        nodes = [
            n
            for n in self.cache.iter_nodes()
            if not n.is_root and Tier.DEVICE in n.blocks and len(n.blocks) > 1 and not n.children
        ]
        if nodes:
            self.cache.drop_copy(nodes[pick % len(nodes)], Tier.DEVICE)

    @rule()
    def sync(self) -> None:
        epoch, seq = self.directory.sync_state("r0")
        batch = self.log.since(seq, epoch)
        assert batch is not None
        assert self.directory.apply("r0", batch)

    @invariant()
    def directory_matches_radix_after_sync(self) -> None:
        self.sync()
        self.cache.check_invariants()
        self.directory.check_invariants()
        assert all(directory_view(self.directory, self.cache, "r0").values())
        fresh = PrefixDirectory()
        fresh.add_replica("r0")
        fresh.load_snapshot("r0", self.log.snapshot(""))
        for tier in Tier:
            assert fresh.num_blocks("r0", tier) == self.directory.num_blocks("r0", tier)
        space = KeySpace(BS)
        for tokens in self.prompts[-3:]:
            keys = space.keys(tokens)
            got = self.directory.match(keys).get("r0", TierMatch())
            engine = self.cache.match(tokens, record=False, tier=None)
            assert got.blocks == engine.num_tokens // BS


TestDirectoryFollowsRadix = DirectoryFollowsRadix.TestCase
TestDirectoryFollowsRadix.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None
)


def test_keys_are_the_engines_own_block_hashes() -> None:
    cache = make_cache()
    tokens = list(range(1, 23))
    put(cache, tokens, "tenant-a")
    node = cache.match(tokens, "tenant-a", record=False).node
    assert KeySpace(BS).keys(tokens, "tenant-a") == node.hashes
    assert KeySpace(BS).keys(tokens, "tenant-b") != node.hashes
    assert KeySpace(BS).key_space_id == cache.root(None).last_hash().hex()


def test_the_model_fingerprint_flows_into_the_keys() -> None:
    from kvpilot.memory.hashing import ModelFingerprint

    model = ModelFingerprint.of("llama-3-70b bf16 block 4").digest
    pools = {Tier.DEVICE: BlockPool(48)}
    cache = RadixCache(BS, pools, None, model)
    tokens = list(range(1, 23))
    put(cache, tokens)
    node = cache.match(tokens, record=False).node
    space = KeySpace.of_radix(cache)
    assert space.model == model and space.keys(tokens) == node.hashes
    assert KeySpace(BS).keys(tokens) != node.hashes  # another model's keys never match
    directory = PrefixDirectory(space.key_space_id)
    directory.add_replica("r")
    with pytest.raises(ConfigError, match="another model"):
        directory.load_snapshot("r", KVEventLog(make_cache()).snapshot(KeySpace(BS).key_space_id))


def test_match_counts_the_contiguous_prefix_by_best_tier() -> None:
    space = KeySpace(BS)
    keys = space.keys(list(range(40)))  # 10 blocks
    k = [keys[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(10)]
    directory = PrefixDirectory()
    for name in ("a", "b", "c"):
        directory.add_replica(name)
    log_a = _batch("a", [(Tier.DEVICE, k[:4]), (Tier.HOST, k[:6])])
    log_b = _batch("b", [(Tier.HOST, k[:2]), (Tier.DEVICE, k[3:10])])
    for name, (snap, batch) in (("a", log_a), ("b", log_b)):
        directory.load_snapshot(name, snap)
        assert directory.apply(name, batch)
    got = directory.match(keys)
    assert got["a"] == TierMatch(device=4, host=2, disk=0)
    assert got["b"] == TierMatch(device=0, host=2, disk=0)  # block 2 is missing: stops there
    assert "c" not in got
    directory.set_live("a", False)
    assert "a" not in directory.match(keys)
    directory.remove_replica("a")
    directory.check_invariants()
    assert directory.match(keys) == {"b": TierMatch(host=2)}


def _batch(name: str, stores: list[tuple[Tier, list[bytes]]]):  # type: ignore[no-untyped-def]
    from kvpilot.fleet.events import EventBatch, KVEvent, KVEventKind, ReplicaSnapshot

    events = tuple(
        KVEvent(
            i + 1,
            KVEventKind.COMMITTED if t is Tier.DEVICE else KVEventKind.MOVED,
            t,
            b"".join(keys),
        )
        for i, (t, keys) in enumerate(stores)
    )
    return ReplicaSnapshot(f"epoch-{name}", 0, ""), EventBatch(f"epoch-{name}", len(events), events)


def test_gap_or_new_epoch_forces_a_resync() -> None:
    cache = make_cache()
    log = KVEventLog(cache, capacity=2)
    directory = PrefixDirectory()
    directory.add_replica("r")
    directory.load_snapshot("r", log.snapshot(""))
    for i in range(4):
        put(cache, [1000 * i + j for j in range(8)])
    assert log.since(0, log.epoch) is None  # the log kept only the last 2 events: a gap
    stale = log.since(log.seq - 1, log.epoch)
    assert stale is not None and not directory.apply("r", stale)
    directory.load_snapshot("r", log.snapshot(""))
    assert all(directory_view(directory, cache, "r").values())
    restarted = KVEventLog(make_cache(), capacity=8)
    batch = restarted.since(0, None)
    assert batch is not None and not directory.apply("r", batch)  # another epoch


def test_replica_with_another_key_space_is_refused() -> None:
    directory = PrefixDirectory(KeySpace(BS).key_space_id)
    directory.add_replica("r")
    log = KVEventLog(make_cache())
    with pytest.raises(ConfigError, match="another model"):
        directory.load_snapshot("r", log.snapshot("0" * 32))


def test_prompt_key_cache_extends_a_session_and_notices_rewrites() -> None:
    space = KeySpace(BS)
    cache = PromptKeyCache(space)
    first = list(range(10))
    assert cache.keys(first, None, "s") == space.keys(first)
    grown = [*first, 11, 12, 13, 14, 15, 16, 17]
    assert cache.keys(grown, None, "s") == space.keys(grown)
    rewritten = [99, *grown[1:]]
    assert cache.keys(rewritten, None, "s") == space.keys(rewritten)
    assert cache.keys(grown, "salt", "s") == space.keys(grown, "salt")
