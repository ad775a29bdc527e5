"""When a branch stops: the engine's inline stop test (`Engine._append_token`) and the
request's `stop_rule` against `stop_reason`'s rule, applied token by token to the stream."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine import Engine, EngineConfig, SamplingParams, VirtualClock
from kvpilot.engine.outputs import stop_rule

from fake_executor import FakeExecutor, oracle_generate

B = 16


def expected_stop(
    stream: list[int], stops: set[int], max_tokens: int, room: int
) -> tuple[list[int], str]:
    """The output and finish reason `stop_reason` gives, checked after every token: a stop
    token, then ``max_tokens``, then the model's length (``room`` tokens after the prompt)."""
    for i, token in enumerate(stream):
        if token in stops:
            return stream[: i + 1], "stop"
        if i + 1 >= max_tokens or i + 1 >= room:
            return stream[: i + 1], "length"
    raise AssertionError("the stream is shorter than any limit")


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    prompt_len=st.integers(1, 40),
    picks=st.lists(st.integers(0, 19), max_size=2),
    eos_picks=st.lists(st.integers(0, 19), max_size=2),
    ignore_eos=st.booleans(),
    max_tokens=st.integers(1, 12),
    room=st.integers(1, 14),
)
def test_engine_stops_where_the_rule_says(
    seed: int,
    prompt_len: int,
    picks: list[int],
    eos_picks: list[int],
    ignore_eos: bool,
    max_tokens: int,
    room: int,
) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(500) for _ in range(prompt_len)]
    stream = oracle_generate(prompt, SamplingParams(max_tokens=20))
    stop_ids = tuple(stream[i] for i in picks)
    eos = {stream[i] for i in eos_picks}
    engine = Engine(
        FakeExecutor(64, B),
        EngineConfig.from_kwargs(block_size=B),
        vocab_size=500,
        eos_token_ids=eos,
        max_model_len=prompt_len + room,
        clock=VirtualClock(),
    )
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_ids, ignore_eos=ignore_eos)
    out = engine.generate([prompt], params)[0]
    stops = set(stop_ids) | (set() if ignore_eos else eos)
    tokens, reason = expected_stop(stream, stops, max_tokens, room)
    assert list(out.token_ids) == tokens
    assert out.outputs[0].finish_reason == reason


def test_stop_rule_takes_eos_unless_ignored() -> None:
    eos = frozenset({2, 3})
    assert stop_rule(SamplingParams(stop_token_ids=(7,)), eos, None) == ({2, 3, 7}, ())
    assert stop_rule(SamplingParams(stop_token_ids=(7,), ignore_eos=True), eos, None) == ({7}, ())
    assert stop_rule(SamplingParams(), frozenset(), None) == (frozenset(), ())
    # Stop strings need a tokenizer to be found in the text.
    assert stop_rule(SamplingParams(stop=("x",)), eos, None)[1] == ()
    assert stop_rule(SamplingParams(stop=("x",)), eos, object())[1] == ("x",)
