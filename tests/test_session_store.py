"""Paused sessions survive a restart: tokens, salt and meta come back exactly."""

from __future__ import annotations

import itertools
from array import array
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.errors import ConfigError, InvalidRequest, KvpilotError
from kvpilot.store import SessionStore, StoredSession

from kill import sigkill_when_ready


def test_save_then_load_returns_the_same_session(tmp_path: Path) -> None:
    clock = itertools.count(100.0).__next__
    with SessionStore(tmp_path, clock=clock) as store:
        store.save("s1", [1, 2, 3, 70000], "tenant-a", {"tool": "pytest", "wait_s": 4.5})
        assert store.load("s1") == StoredSession(
            "s1", [1, 2, 3, 70000], "tenant-a", {"tool": "pytest", "wait_s": 4.5}, 100.0
        )


def test_a_session_without_salt_or_tokens_round_trips(tmp_path: Path) -> None:
    with SessionStore(tmp_path) as store:
        store.save("empty", [], None, {})
        loaded = store.load("empty")
        assert loaded is not None
        assert (loaded.tokens, loaded.salt, loaded.meta) == ([], None, {})


def test_tokens_may_be_any_int_sequence(tmp_path: Path) -> None:
    with SessionStore(tmp_path) as store:
        store.save("a", array("i", [5, 6]), None, {})
        store.save("n", np.array([7, 8], dtype=np.int64), None, {})
        store.save("r", range(3), None, {})
        assert [store.load(s).tokens for s in "anr"] == [[5, 6], [7, 8], [0, 1, 2]]  # type: ignore[union-attr]


def test_load_of_an_unknown_session_is_none(tmp_path: Path) -> None:
    with SessionStore(tmp_path) as store:
        assert store.load("nope") is None
        assert "nope" not in store


def test_save_replaces_an_existing_session(tmp_path: Path) -> None:
    with SessionStore(tmp_path) as store:
        store.save("s", [1], None, {"turn": 1})
        store.save("s", [1, 2], "t", {"turn": 2})
        loaded = store.load("s")
        assert loaded is not None and (loaded.tokens, loaded.meta) == ([1, 2], {"turn": 2})
        assert len(store) == 1


def test_delete_removes_a_session(tmp_path: Path) -> None:
    with SessionStore(tmp_path) as store:
        store.save("s", [1], None, {})
        assert store.delete("s") and not store.delete("s")
        assert store.load("s") is None and len(store) == 0
    with SessionStore(tmp_path) as store:
        assert store.load("s") is None


def test_list_names_saved_sessions_oldest_first(tmp_path: Path) -> None:
    clock = itertools.count().__next__
    with SessionStore(tmp_path, clock=clock) as store:
        for sid in ("b", "a", "c"):
            store.save(sid, [1], None, {})
        store.save("b", [1, 2], None, {})
        assert store.list() == ["a", "c", "b"]


def test_a_hundred_thousand_token_session_round_trips(tmp_path: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, 152_064, size=100_000).tolist()
    with SessionStore(tmp_path) as store:
        store.save("long", tokens, "t", {"turns": 40})
    with SessionStore(tmp_path) as store:
        loaded = store.load("long")
        assert loaded is not None and loaded.tokens == tokens


_CHILD = """
import sys, time
from kvpilot.store import SessionStore
store = SessionStore(sys.argv[1])
store.save("paused", list(range(5000)), "tenant-b", {"tool": "human_approval"})
print("READY", flush=True)  # the parent SIGKILLs it here: no close()
while True:
    time.sleep(60)
"""


def test_a_saved_session_survives_a_killed_process(tmp_path: Path) -> None:
    sigkill_when_ready(["-c", _CHILD, str(tmp_path)])
    with SessionStore(tmp_path, create=False) as store:
        loaded = store.load("paused")
        assert loaded is not None
        assert loaded.tokens == list(range(5000))
        assert (loaded.salt, loaded.meta) == ("tenant-b", {"tool": "human_approval"})


def test_token_ids_outside_int32_are_rejected(tmp_path: Path) -> None:
    with SessionStore(tmp_path) as store:
        with pytest.raises(InvalidRequest, match="token ids"):
            store.save("s", [1, -1], None, {})
        with pytest.raises(InvalidRequest, match="token ids"):
            store.save("s", [2**31], None, {})
        with pytest.raises(InvalidRequest, match="ints"):
            store.save("s", [1.5], None, {})  # type: ignore[list-item]
        assert store.list() == []


def test_meta_that_is_not_json_is_rejected(tmp_path: Path) -> None:
    with SessionStore(tmp_path) as store:
        with pytest.raises(InvalidRequest, match="JSON"):
            store.save("s", [1], None, {"when": object()})
        with pytest.raises(InvalidRequest, match="dict"):
            store.save("s", [1], None, ["not", "a", "dict"])  # type: ignore[arg-type]
        assert store.load("s") is None


def test_opening_a_missing_store_without_create_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="create=True"):
        SessionStore(tmp_path, create=False)


def test_a_closed_store_refuses_use_and_close_is_idempotent(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    store.close()
    store.close()
    with pytest.raises(KvpilotError, match="closed"):
        store.load("s")


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=300),
    salt=st.none() | st.text(max_size=20),
    meta=st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=4),
)
def test_any_session_round_trips(
    tmp_path_factory: pytest.TempPathFactory,
    tokens: list[int],
    salt: str | None,
    meta: dict[str, object],
) -> None:
    with SessionStore(tmp_path_factory.mktemp("s")) as store:
        store.save("x", tokens, salt, meta)
        loaded = store.load("x")
        assert loaded is not None and (loaded.tokens, loaded.salt, loaded.meta) == (
            tokens,
            salt,
            meta,
        )
