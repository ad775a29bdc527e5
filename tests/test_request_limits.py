"""RequestLimits.check_prompt converts a prompt to the int32 ids a trajectory holds in one
pass and checks them on that copy: it accepts and rejects exactly what checking the list id
by id does, and returns the same ids."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.engine import Engine, SamplingParams
from kvpilot.engine.clock import VirtualClock
from kvpilot.engine.request import RequestLimits
from kvpilot.errors import InvalidRequest, PromptTooLong

from fake_executor import FakeExecutor

INT32 = 2**31


def checked_id_by_id(limits: RequestLimits, tokens: list[int]) -> list[int] | str:
    """The ids, or the error's kind: vocabulary, int32 range (no vocabulary), or too long."""
    limit = limits.vocab_size
    if any(t < 0 or (limit is not None and t >= limit) for t in tokens):
        return "vocabulary"
    if any(t >= INT32 for t in tokens):
        return "int32"
    if len(tokens) >= limits.max_model_len:
        return "too long"
    return tokens


def checked(limits: RequestLimits, tokens: list[int]) -> list[int] | str:
    try:
        return limits.check_prompt(tokens).tolist()
    except PromptTooLong:
        return "too long"
    except InvalidRequest as exc:
        return "vocabulary" if "vocabulary" in str(exc) else "int32"


ids = st.one_of(
    st.integers(0, 600), st.integers(-(2**40), 2**40), st.sampled_from([-1, INT32 - 1, INT32])
)


@given(st.lists(ids, min_size=1, max_size=40), st.sampled_from([None, 500, INT32]))
def test_check_prompt_matches_checking_each_id(tokens: list[int], vocab: int | None) -> None:
    limits = RequestLimits(max_model_len=30, vocab_size=vocab, kv_blocks=64, block_size=4)
    assert checked(limits, tokens) == checked_id_by_id(limits, tokens)


def test_the_error_names_the_ids_out_of_the_vocabulary() -> None:
    limits = RequestLimits(max_model_len=100, vocab_size=500, kv_blocks=64, block_size=4)
    with pytest.raises(InvalidRequest, match=r"\[500, -1, 4294967296\] out of range \[0, 500\)"):
        limits.check_prompt([1, 500, -1, 2**32])
    with pytest.raises(InvalidRequest, match="the prompt is empty"):
        limits.check_prompt([])


def test_an_id_outside_int32_leaves_a_paused_session_paused() -> None:
    """Without a vocabulary, only int32 bounds the ids; a turn that breaks it is refused
    before it resumes the session it was meant for."""
    engine = Engine(FakeExecutor(64, 16), vocab_size=None, clock=VirtualClock())
    session = engine.open_session()
    session.generate([1, 2, 3], SamplingParams(max_tokens=2))
    session.pause(expected_wait_s=5.0)
    with pytest.raises(InvalidRequest, match="int32"):
        session.submit([4, INT32], SamplingParams(max_tokens=2))
    assert session.last_pause is not None and session.idle
    assert len(session.traj.tokens) == 5
    engine.check_invariants()
