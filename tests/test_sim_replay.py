"""Trace replay inputs: the hashed JSONL schema, text tokenization, session shrinking."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.errors import ConfigError
from kvpilot.sim.replay import ReplayOptions, load_replay, shrink_session
from kvpilot.trace.ideal import ideal_hit_rate
from kvpilot.trace.schema import (
    CharsPerToken,
    HashedCall,
    block_hash_ids,
    detect_trace_format,
    hashed_tokens,
    load_hashed_trace,
)

MINISWE = Path(__file__).resolve().parents[2] / "shared/traces/lmcache-agent-trace/miniswe"


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def call(ts: float, n_in: int, ids: list[int], sid: str | None = "a", n_out: int = 8) -> dict:
    row: dict[str, object] = {
        "timestamp": ts,
        "input_length": n_in,
        "output_length": n_out,
        "hash_ids": ids,
    }
    if sid is not None:
        row["session_id"] = sid
    return row


def test_hashed_trace_parses_and_sorts_by_timestamp(tmp_path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [call(2000, 40, [1, 2, 3], "b"), call(1000, 20, [1, 2], "a", 5)],
    )
    calls = load_hashed_trace(path, timestamp_unit="ms")
    assert [c.session_id for c in calls] == ["a", "b"]
    assert calls[0].timestamp_s == 1.0 and calls[1].timestamp_s == 2.0
    assert calls[0].hash_ids == (1, 2) and calls[0].output_length == 5
    assert detect_trace_format(path) == "hashed"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"timestamp": 0, "input_length": 16, "output_length": 1}, "missing field"),
        (call(0, 0, []), "at least 1"),
        (call(0, -5, [1]), "non-negative integer"),
        (call("soon", 16, [1]), "timestamp"),  # type: ignore[arg-type]
        (call(0, 16, [1, "x"]), "hash_ids"),  # type: ignore[list-item]
        (call(0, 16, [1, -2]), "hash_ids"),
        (call(0, 16, [1, 2]), "cover more than"),
        ({**call(0, 16, [1]), "session_id": [1]}, "session_id"),
        ([1, 2, 3], "JSON object"),
    ],
)
def test_bad_hashed_records_fail_with_file_and_line(tmp_path, row, message) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [call(0, 16, [7]), row])
    with pytest.raises(ConfigError, match=message) as info:
        load_hashed_trace(path)
    assert "bad.jsonl:2" in str(info.value)


def test_a_line_that_is_not_json_names_its_line(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(call(0, 16, [1])) + "\n{oops\n")
    with pytest.raises(ConfigError, match=r"t\.jsonl:2: not JSON"):
        load_hashed_trace(path)


def test_unknown_trace_kind_and_missing_paths_are_errors(tmp_path) -> None:
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "hi"}])
    with pytest.raises(ConfigError, match="neither a text trace"):
        detect_trace_format(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_hashed_trace(tmp_path / "missing.jsonl")


def test_equal_hash_ids_map_to_equal_token_blocks() -> None:
    a = HashedCall("s", 0.0, 48, 1, (10, 11, 12), line=0)
    b = HashedCall("s", 1.0, 40, 1, (10, 11, 99), line=1)
    ta, tb = hashed_tokens(a, 32000), hashed_tokens(b, 32000)
    assert len(ta) == 48 and len(tb) == 40
    assert ta[:32] == tb[:32]
    assert ta[32:40] != tb[32:40]
    assert all(1 <= t < 32000 for t in ta + tb)


def test_tokens_beyond_the_hashed_blocks_are_unique_per_call() -> None:
    a = HashedCall("s", 0.0, 40, 1, (5,), line=0)
    b = HashedCall("s", 0.0, 40, 1, (5,), line=1)
    ta, tb = hashed_tokens(a, 1000), hashed_tokens(b, 1000)
    assert ta[:16] == tb[:16] and ta[16:] != tb[16:]


def test_chars_per_token_keeps_common_text_prefixes_common() -> None:
    tok = CharsPerToken(4, 32000)
    a, b = tok("hello world, this is"), tok("hello world, this is a longer text")
    assert len(a) == 5 and a == b[:5]
    assert tok("abcdefgh")[:1] != tok("abcXefgh")[:1]
    assert tok("") == []
    with pytest.raises(ConfigError):
        CharsPerToken(0)


def test_text_trace_exported_as_hash_ids_keeps_its_sharing(tmp_path) -> None:
    rng = list(range(1, 400))
    prompts = [rng[:100], rng[:180], rng[:180] + [7] * 30, rng[:50] + [9] * 60]
    rows = [call(i, len(p), block_hash_ids(p)) for i, p in enumerate(prompts)]
    path = write_jsonl(tmp_path / "exported.jsonl", rows)
    replayed = [hashed_tokens(c, 32000) for c in load_hashed_trace(path)]
    assert [len(t) for t in replayed] == [len(p) for p in prompts]
    assert ideal_hit_rate(replayed, 16) == pytest.approx(ideal_hit_rate(prompts, 16))


def test_shrink_session_cuts_the_shared_head_and_stops_at_long_calls() -> None:
    head = list(range(1000))
    calls = [head + [1] * 10, head + [1] * 10 + [2] * 500, head + [1] * 10 + [2] * 2000]
    out = shrink_session(calls, head_tokens=100, max_call_tokens=800)
    assert [len(c) for c in out] == [100, 600]
    assert out[1][:100] == out[0]
    assert shrink_session(calls, None, None) == [list(c) for c in calls]


def test_hashed_replay_groups_calls_into_sessions_in_time_order(tmp_path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            call(0.0, 32, [1, 2], "s1", 4),
            call(1.0, 48, [1, 2, 3], "s1", 6),
            call(0.5, 16, [8], None, 2),
            call(3.0, 16, [9], "s2", 2000),
        ],
    )
    sessions = load_replay([path], ReplayOptions(max_output_tokens=100))
    assert [s.session_id for s in sessions] == ["s1", "call-2", "s2"]
    s1 = sessions[0]
    assert [c.offset_s for c in s1.calls] == [0.0, 1.0]
    assert [c.output_tokens for c in s1.calls] == [4, 6]
    assert s1.calls[1].prompt[:32] == s1.calls[0].prompt
    assert sessions[2].calls[0].output_tokens == 100


def test_replay_needs_a_trace_that_fits(tmp_path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [call(0.0, 32, [1, 2])])
    with pytest.raises(ConfigError, match="fits"):
        load_replay([path], ReplayOptions(max_call_tokens=10))
    with pytest.raises(ConfigError, match="at least one"):
        load_replay([], ReplayOptions())


@pytest.mark.skipif(not MINISWE.is_dir(), reason="miniswe traces not present")
def test_miniswe_sessions_load_as_growing_calls() -> None:
    sessions = load_replay(
        [MINISWE],
        ReplayOptions(head_tokens=256, max_call_tokens=3000, max_sessions=2, min_calls=3),
    )
    assert len(sessions) == 2
    for s in sessions:
        assert len(s.calls[0].prompt) <= 257
        offsets = [c.offset_s for c in s.calls]
        assert offsets == sorted(offsets)
        for prev, nxt in zip(s.calls, s.calls[1:], strict=False):
            assert nxt.prompt[: len(prev.prompt) - 1] == prev.prompt[:-1]
