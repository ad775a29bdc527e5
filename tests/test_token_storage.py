"""Token ids are held as int32 arrays inside (trajectory, request) and handed out as ints.

A trajectory's tokens and a request's prompt stay ``array('i')`` so that a prompt is never
turned into one Python int per id on the engine's path; what the engine hands out (a
snapshot's ``prompt_token_ids``, ``Session.tokens``) is a tuple or list of plain ints, made
once, on the first read. An array never equals a list, and JSON refuses one: these tests
fail if an array leaks out, or if the int32 storage matches the prefix cache differently.
"""

from __future__ import annotations

import json
import random
from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine import Engine, EngineConfig, PromptIds, SamplingParams, VirtualClock
from kvpilot.memory import KVConfig, KVManager

from fake_executor import FakeExecutor

B = 4


def make_engine() -> Engine:
    executor = FakeExecutor(256, B)
    config = EngineConfig.from_kwargs(block_size=B)
    return Engine(executor, config, vocab_size=500, max_model_len=4096, clock=VirtualClock())


def test_snapshots_hand_out_the_prompt_as_one_tuple_of_ints_made_on_first_read() -> None:
    engine = make_engine()
    ids = [random.Random(3).randrange(500) for _ in range(30)]
    for prompt in (ids, array("i", ids)):
        rid = engine.add_request(prompt, SamplingParams(max_tokens=3))
        request = engine.requests[rid]
        outs = [out for _ in range(3) for out in engine.step() if out.request_id == rid]
        assert outs[-1].finished
        assert request.prompt_ids._tuple is None  # stepping never turned the prompt into ints
        first = outs[0].prompt_token_ids
        assert type(first) is tuple and all(type(t) is int for t in first)
        assert first == tuple(ids) and list(first) == ids
        assert json.loads(json.dumps({"prompt": first})) == {"prompt": ids}
        assert all(out.prompt_token_ids is first for out in outs)  # converted once, shared
        assert request.prompt_token_ids is first
        assert outs[-1].prompt_tokens == len(ids)
        again = outs[-1]._replace(prompt_ids=PromptIds(array("i", ids)))
        assert again == outs[-1]  # equal ids: equal snapshots (a run's and a step's outputs)
        assert again != again._replace(prompt_ids=PromptIds(array("i", ids[1:])))


def test_a_sessions_tokens_are_a_fresh_list_of_ints() -> None:
    engine = make_engine()
    session = engine.open_session()
    out = session.generate([5, 6, 7], SamplingParams(max_tokens=2))
    tokens = session.tokens
    assert type(tokens) is list and all(type(t) is int for t in tokens)
    assert tokens == [5, 6, 7, *out.token_ids][: session.num_tokens]
    assert json.loads(json.dumps(tokens)) == tokens
    tokens.append(9)  # the caller's own copy
    assert session.num_tokens == len(tokens) - 1
    assert type(session.traj.tokens) is array and session.traj.tokens.typecode == "i"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40),
    st.lists(st.integers(0, 2**31 - 1), max_size=20),
    st.integers(0, 40),
    st.sampled_from(["list", "tuple", "array"]),
)
def test_an_int32_trajectory_reuses_the_prefix_a_list_of_its_ids_would(
    first: list[int], tail: list[int], keep: int, form: str
) -> None:
    """A second trajectory that shares ``keep`` ids with a committed first one reuses the
    whole blocks of their common prefix (short of its last token), whatever form its ids
    came in, the int32 ids up to 2**31 - 1 included; its tokens stay one int32 array."""
    mgr = KVManager(KVConfig(block_size=B, num_device_blocks=64))
    one = mgr.open_trajectory(tokens=first)
    one.reuse_prefix()
    one.allocate(len(first))
    one.mark_computed(len(first))
    one.commit()
    ids = first[:keep] + tail
    if not ids:
        return
    given_ids = {"list": ids, "tuple": tuple(ids), "array": array("i", ids)}[form]
    two = mgr.open_trajectory(tokens=given_ids)
    common = 0
    while common < min(len(first), len(ids)) and first[common] == ids[common]:
        common += 1
    expected = min(common // B * B, (len(ids) - 1) // B * B)
    assert two.reuse_prefix() == expected
    assert type(two.tokens) is array and two.tokens.typecode == "i"
    assert two.tokens.tolist() == ids and two.token_array() is two.tokens
    two.append_token(2**31 - 1)
    two.append_tokens([1, 2])
    assert two.tokens.tolist() == [*ids, 2**31 - 1, 1, 2]
    mgr.check_invariants()
