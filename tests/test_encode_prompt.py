"""encode_prompt: a list of ints takes a fast path in C; every other input numpy's; both
accept and reject exactly the same prompts, with the same token ids."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.engine.request import encode_prompt
from kvpilot.errors import InvalidRequest


def numpy_path(prompt: Any) -> list[int] | None:
    """What the numpy path alone returns (None: InvalidRequest)."""
    try:
        arr = np.asarray(prompt)
    except (TypeError, ValueError):
        return None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        return None
    return list(arr.tolist())


def encoded(prompt: Any) -> list[int] | None:
    try:
        return encode_prompt(None, prompt, add_special_tokens=True)
    except InvalidRequest:
        return None


@pytest.mark.parametrize(
    "prompt",
    [
        [1, 2, 3],
        [],
        [True, False],
        [True, 2],
        [np.int64(4), 5],
        [np.uint64(2**63 + 1)],
        [2**40],
        [2**70],
        [-3, 7],
        [1.0, 2],
        [np.float64(1.0)],
        [[1, 2], [3, 4]],
        ["a"],
        [None],
        (1, 2),
        np.array([3, 4]),
    ],
)
def test_list_fast_path_matches_numpy(prompt: Any) -> None:
    out = encoded(prompt)
    assert out == numpy_path(prompt)
    if out is not None:
        assert all(type(t) is int for t in out)


@given(st.lists(st.one_of(st.integers(-(2**70), 2**70), st.booleans(), st.floats()), max_size=8))
def test_any_list_is_encoded_as_numpy_would(prompt: list[Any]) -> None:
    assert encoded(prompt) == numpy_path(prompt)


def test_text_needs_a_tokenizer() -> None:
    with pytest.raises(InvalidRequest, match="no tokenizer"):
        encode_prompt(None, "hello", add_special_tokens=True)
