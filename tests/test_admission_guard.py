"""The hot-state guard's shortfall needs no walk of the radix cache: it equals the figure
counted from the trajectory's cached prefix (what it need not allocate, less the room that
prefix takes up once locked), whatever the cache holds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.admission import blocks_short
from kvpilot.errors import OutOfBlocks
from kvpilot.memory import KVConfig, KVManager, Tier, Trajectory

BLOCK = 4

# A prompt: a shared head (one of a few) and a tail of small token ids, so prefixes collide.
prompts = st.tuples(st.integers(0, 2), st.integers(0, 12), st.lists(st.integers(0, 3), max_size=14))
# Per turn: the prompt, keep the trajectory open (locks its path), then release its KV.
turns = st.lists(st.tuples(prompts, st.booleans(), st.booleans()), max_size=8)


def tokens_of(prompt: tuple[int, int, list[int]]) -> list[int]:
    head, head_len, tail = prompt
    return [100 + head] * head_len + tail + [7]


def counted_from_the_prefix(kv: KVManager, traj: Trajectory) -> int:
    """The shortfall counted the long way, from a peek at the cached prefix."""
    tokens = traj.token_array()
    held = len(traj.block_table)
    peek = kv.radix.peek(tokens[: max(len(tokens) - 1, 0)], traj.salt)
    have = max(held, peek.blocks_by_tier.get(Tier.DEVICE, 0))
    room = kv.free_blocks() - (have - held)  # its cached path is not room for it
    return -(-len(tokens) // kv.block_size) - have - room


def run(kv: KVManager, tokens: list[int], keep_open: bool, release: bool) -> Trajectory:
    traj = kv.open_trajectory(tokens=tokens)
    try:
        traj.reuse_prefix()
        todo = len(tokens) - traj.num_computed_tokens
        traj.allocate(todo)
        traj.mark_computed(todo)
        traj.commit()
    except OutOfBlocks:
        pass
    if release:
        traj.release_kv()
    if not keep_open:
        traj.close()
    return traj


@settings(max_examples=150, deadline=None)
@given(turns, prompts, st.sampled_from(["waiting", "reused", "partly computed"]))
def test_the_shortfall_is_the_one_counted_from_the_cached_prefix(
    history: list[tuple[tuple[int, int, list[int]], bool, bool]],
    prompt: tuple[int, int, list[int]],
    state: str,
) -> None:
    kv = KVManager(KVConfig(block_size=BLOCK, num_device_blocks=24))
    for turn, keep_open, release in history:
        run(kv, tokens_of(turn), keep_open, release)
    traj = kv.open_trajectory(tokens=tokens_of(prompt))
    if state != "waiting":
        traj.reuse_prefix()
    if state == "partly computed" and traj.num_computed_tokens < len(traj.tokens):
        try:
            traj.allocate(1)
            traj.mark_computed(1)
        except OutOfBlocks:
            pass
    kv.check_invariants()
    assert blocks_short(kv, traj) == counted_from_the_prefix(kv, traj)
