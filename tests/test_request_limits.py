"""RequestLimits.check_prompt converts a prompt to the int32 ids a trajectory holds in one
pass and checks them on that copy: it accepts and rejects exactly what checking the list id
by id does, and returns the same ids."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvpilot.engine import Engine, SamplingParams
from kvpilot.engine.clock import VirtualClock
from kvpilot.engine.request import RequestLimits, encode_prompt
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


@given(st.lists(ids, min_size=1, max_size=40), st.sampled_from([None, 500, INT32, 2 * INT32]))
@example([3, 500], 500)  # the vocabulary's edge: refused
@example([499, 0], 500)  # and just inside it
@example([7, -1], None)  # negative, without a vocabulary: refused
@example([INT32 - 1], INT32)  # the largest int32 id, in a vocabulary of 2**31
@example([7, -1], 2 * INT32)  # a vocabulary past int32: its ids are still int32
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


Converted = list[int] | str  # the int32 ids (as ints), or the error


def full_path(limits: RequestLimits, prompt: object, history: int) -> Converted:
    """encode_prompt then check_prompt, one after the other (the error's message if refused)."""
    try:
        tokens = encode_prompt(None, prompt, add_special_tokens=True)  # type: ignore[arg-type]
        return limits.check_prompt(tokens, history).tolist()
    except InvalidRequest as exc:
        return f"{type(exc).__name__}: {exc}"


def one_pass(limits: RequestLimits, prompt: object, history: int) -> Converted:
    try:
        ids = limits.prompt_ids(
            None,
            prompt,  # type: ignore[arg-type]
            history,
            add_special_tokens=True,
        )
    except InvalidRequest as exc:
        return f"{type(exc).__name__}: {exc}"
    assert isinstance(ids, array) and ids.typecode == "i"
    return ids.tolist()


prompt_items = st.one_of(ids, st.booleans(), st.floats(allow_nan=False), st.just(np.int64(7)))


@given(
    st.lists(prompt_items, max_size=12),
    st.sampled_from(["list", "array('i')", "array('q')", "tuple"]),
    st.sampled_from([None, 500, INT32]),
    st.integers(0, 12),
)
@example([1, 2, 3], "list", None, 9)  # too long with its history
@example([1, 2, 3], "array('i')", 500, 9)
@example([], "array('i')", None, 0)
@example([True, 2], "list", 500, 0)
def test_prompt_ids_accepts_and_refuses_what_the_full_path_does(
    items: list[object], form: str, vocab: int | None, history: int
) -> None:
    """`prompt_ids` converts a list or an int32 array once; whatever the prompt, the ids
    and every error (its type and message) are the full path's."""
    limits = RequestLimits(max_model_len=10, vocab_size=vocab, kv_blocks=64, block_size=4)
    prompt: object = items
    if form != "list":
        code = form[7] if form.startswith("array") else ""
        try:
            prompt = array(code, items) if code else tuple(items)  # type: ignore[arg-type]
        except (TypeError, OverflowError):
            return  # not an array of that type: nothing to compare
    assert one_pass(limits, prompt, history) == full_path(limits, prompt, history)


def test_prompt_ids_copies_an_int32_array() -> None:
    limits = RequestLimits(max_model_len=30, vocab_size=500, kv_blocks=64, block_size=4)
    prompt = array("i", [3, 4, 5])
    held = limits.prompt_ids(None, prompt, 0, add_special_tokens=True)
    prompt[0] = 9
    assert held.tolist() == [3, 4, 5]
