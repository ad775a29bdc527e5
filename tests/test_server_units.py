"""Server pieces that need no HTTP: turn planning, tenants, limits, stream deltas, engine loop."""

from __future__ import annotations

import asyncio
import json
from array import array
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.engine import (
    CompletionOutput,
    Engine,
    EngineConfig,
    PromptIds,
    RequestOutput,
    SamplingParams,
)
from kvpilot.errors import ConfigError, PromptTooLong
from kvpilot.server.async_engine import AsyncEngine, EngineFault
from kvpilot.server.limits import ServerLimits, resolve_max_tokens
from kvpilot.server.protocol import ApiError, CompletionRequest
from kvpilot.server.streaming import Deltas
from kvpilot.server.tenancy import ApiKeys, cache_salt
from kvpilot.server.turns import (
    chat_resends_history,
    common_prefix_len,
    completion_resends_history,
    plan_turn,
)

from fake_executor import FakeExecutor, oracle_generate

tokens = st.lists(st.integers(0, 3), max_size=40)


# -- turn planning ---------------------------------------------------------------------------


@given(tokens, tokens)
def test_common_prefix_len_is_the_first_difference(a: list[int], b: list[int]) -> None:
    k = common_prefix_len(a, b)
    assert a[:k] == b[:k]
    assert k == min(len(a), len(b)) or a[k] != b[k]


@given(tokens, tokens)
def test_a_turn_plan_always_rebuilds_the_whole_prompt(
    history: list[int], prompt: list[int]
) -> None:
    plan = plan_turn(history, prompt)
    if plan.restart:
        assert plan.tokens == prompt
        assert plan.divergence_index == common_prefix_len(history, prompt)
    else:
        assert history + plan.tokens == prompt
        assert plan.divergence_index is None


def test_a_prompt_extending_the_history_submits_only_the_suffix() -> None:
    plan = plan_turn([1, 2, 3], [1, 2, 3, 4, 5])
    assert (plan.tokens, plan.restart, plan.divergence_index) == ([4, 5], False, None)


def test_a_prompt_diverging_from_the_history_restarts_and_reports_where() -> None:
    plan = plan_turn([1, 2, 3, 4], [1, 2, 9, 4, 5])
    assert (plan.tokens, plan.restart, plan.divergence_index) == ([1, 2, 9, 4, 5], True, 2)


def test_a_prompt_equal_to_the_history_restarts_at_its_end() -> None:
    plan = plan_turn([1, 2, 3], [1, 2, 3])
    assert plan.restart and plan.divergence_index == 3


def test_chat_auto_mode_treats_a_request_with_assistant_messages_as_a_resend() -> None:
    resend = [{"role": "user"}, {"role": "assistant"}, {"role": "user"}]
    assert chat_resends_history("auto", resend)
    assert not chat_resends_history("auto", [{"role": "tool"}])
    assert chat_resends_history("full", [{"role": "user"}])
    assert not chat_resends_history("append", resend)


def test_completion_auto_mode_looks_for_the_opening_prompt() -> None:
    assert completion_resends_history("auto", [1, 2, 3, 4], opening=[1, 2])
    assert not completion_resends_history("auto", [3, 4], opening=[1, 2])
    assert not completion_resends_history("append", [1, 2, 3], opening=[1, 2])
    assert completion_resends_history("full", [7], opening=[1, 2])


# -- tenants -------------------------------------------------------------------------------


def test_api_keys_load_from_json_and_from_lines(tmp_path: Path) -> None:
    as_json = tmp_path / "keys.json"
    as_json.write_text(json.dumps({"k1": "alice", "k2": "bob"}))
    as_lines = tmp_path / "keys.txt"
    as_lines.write_text("# key tenant\nk1 alice\n\nk2   bob\n")
    for path in (as_json, as_lines):
        keys = ApiKeys.from_file(path)
        assert keys.tenant_for("Bearer k1") == "alice"
        assert keys.tenant_for("bearer k2") == "bob"
        assert keys.tenants == {"alice", "bob"}


@pytest.mark.parametrize("header", [None, "", "Bearer", "Basic k1", "Bearer nope"])
def test_a_request_without_a_valid_key_is_refused_with_401(header: str | None) -> None:
    with pytest.raises(ApiError) as err:
        ApiKeys({"k1": "alice"}).tenant_for(header)
    assert err.value.status == 401 and "key" in err.value.message


def test_without_keys_every_request_is_the_anonymous_tenant() -> None:
    assert ApiKeys().tenant_for(None) is None


@pytest.mark.parametrize(
    "text", ["k1 alice extra\n", "k1 alice\nk1 bob\n", "k1 te/am\n", '{"k1": 3}', "{not json"]
)
def test_a_malformed_keys_file_is_a_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ConfigError):
        ApiKeys.from_file(path)


def test_cache_salt_separates_tenants_and_explicit_salts() -> None:
    salts = {
        cache_salt(None),
        cache_salt("alice"),
        cache_salt("bob"),
        cache_salt("alice", "x"),
        cache_salt("bob", "x"),
        cache_salt(None, "x"),
    }
    assert len(salts) == 6
    assert cache_salt("alice") == "alice"


# -- limits --------------------------------------------------------------------------------


def test_limits_refuse_what_exceeds_them() -> None:
    limits = ServerLimits(max_tokens_limit=100, max_n=2, max_sessions_per_tenant=3)
    limits.check_n(2)
    limits.check_max_tokens(100)
    with pytest.raises(ApiError, match="n=3"):
        limits.check_n(3)
    with pytest.raises(ApiError, match="max_tokens=101"):
        limits.check_max_tokens(101)


def test_max_tokens_default_is_clipped_and_an_explicit_one_must_fit() -> None:
    assert resolve_max_tokens(None, prompt_tokens=90, max_model_len=100, default=16) == 10
    assert resolve_max_tokens(5, prompt_tokens=90, max_model_len=100, default=16) == 5
    with pytest.raises(PromptTooLong, match="at most 10"):
        resolve_max_tokens(11, prompt_tokens=90, max_model_len=100, default=16)


def test_a_batch_of_several_prompts_is_refused() -> None:
    assert CompletionRequest(prompt=[[1, 2]]).single_prompt() == [1, 2]
    assert CompletionRequest(prompt=["a"]).single_prompt() == "a"
    with pytest.raises(ApiError, match="one prompt per request"):
        CompletionRequest(prompt=["a", "b"]).single_prompt()


# -- stream deltas -------------------------------------------------------------------------


def _snapshot(text: str, reason: str | None = None) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt_ids=PromptIds(array("i")),
        prompt_tokens=0,
        cached_tokens=0,
        cached_tokens_by_tier={"device": 0, "host": 0, "disk": 0},
        outputs=(CompletionOutput(0, text, (), reason),),
        finished=False,
        arrival_time=0.0,
        first_token_time=None,
        finish_time=None,
    )


def test_deltas_hold_back_a_half_decoded_character_until_it_settles() -> None:
    deltas = Deltas(holdback_chars=0)
    assert deltas.update(_snapshot("ab\ufffd")) == [(0, "ab", None)]
    assert deltas.update(_snapshot("abé")) == [(0, "é", None)]
    assert deltas.update(_snapshot("abéc", "length")) == [(0, "c", "length")]
    assert deltas.update(_snapshot("abécd", "length")) == []


def test_deltas_never_send_what_a_stop_string_may_still_cut() -> None:
    deltas = Deltas(holdback_chars=len("END") - 1)
    assert deltas.update(_snapshot("helloEN")) == [(0, "hello", None)]
    assert deltas.update(_snapshot("hello", "stop")) == [(0, "", "stop")]


# -- the engine loop -----------------------------------------------------------------------


def _fake_engine(num_blocks: int = 64) -> Engine:
    config = EngineConfig.from_kwargs(block_size=16)
    return Engine(FakeExecutor(num_blocks, 16), config, vocab_size=500)


def test_the_engine_thread_streams_each_request_to_its_caller() -> None:
    engine = AsyncEngine(_fake_engine())
    engine.start()
    params = SamplingParams(max_tokens=12)
    prompts = [[i, 7, 9] * (i + 1) for i in range(6)]

    async def one(prompt: list[int]) -> list[int]:
        stream, _ = await engine.submit(lambda e: (e.add_request(prompt, params), None))
        seen = 0
        while True:
            output = await stream.next()
            assert output is not None and len(output.token_ids) >= seen
            seen = len(output.token_ids)
            if output.finished:
                return list(output.token_ids)

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        results = asyncio.run(main())
        assert results == [oracle_generate(p, params) for p in prompts]
        assert engine.call_blocking(lambda e: not e.has_unfinished() and not e.requests)
    finally:
        engine.shutdown()


def test_aborting_a_request_frees_its_blocks() -> None:
    engine = AsyncEngine(_fake_engine())
    engine.start()

    async def main() -> None:
        params = SamplingParams(max_tokens=10_000, ignore_eos=True)
        stream, _ = await engine.submit(lambda e: (e.add_request(list(range(40)), params), None))
        first = await stream.next()
        assert first is not None and not first.finished
        engine.abort_soon(stream.request_id)

    try:
        asyncio.run(main())
        engine.call_blocking(lambda e: e.kv.radix.evict(e.kv.device.num_blocks))
        free, total, running = engine.call_blocking(
            lambda e: (e.kv.device.num_free, e.kv.device.num_blocks, e.has_unfinished())
        )
        assert not running and free == total
    finally:
        engine.shutdown()


def test_a_failing_step_fails_its_streams_and_the_loop_goes_on() -> None:
    inner = _fake_engine()
    execute = inner.executor.execute

    def broken(works: object) -> None:
        inner.executor.execute = execute  # type: ignore[method-assign]
        raise RuntimeError("device lost")

    inner.executor.execute = broken  # type: ignore[method-assign]
    engine = AsyncEngine(inner)
    engine.start()

    async def main() -> None:
        stream, _ = await engine.submit(lambda e: (e.add_request([1, 2, 3]), None))
        with pytest.raises(EngineFault, match="device lost"):
            await stream.next()
        stream, _ = await engine.submit(lambda e: (e.add_request([4, 5, 6]), None))
        while not (await stream.next()).finished:  # type: ignore[union-attr]
            pass

    try:
        asyncio.run(main())
        assert engine.running and engine.faults == 1
        engine.call_blocking(lambda e: e.check_invariants(), timeout=30)
    finally:
        engine.shutdown()


def test_a_dead_loop_is_restarted_and_fails_its_streams() -> None:
    engine = AsyncEngine(_fake_engine())
    collect = engine._collect_finished
    calls = []

    def dies_once(inner: Engine) -> None:  # outside any step: escapes the loop itself
        if not calls:
            calls.append(1)
            raise OverflowError("timeout value is too large")
        collect(inner)

    engine._collect_finished = dies_once  # type: ignore[method-assign]
    engine.start()

    async def main() -> None:
        stream, _ = await engine.submit(lambda e: (e.add_request([1, 2, 3]), None))
        with pytest.raises(EngineFault, match="OverflowError"):
            await stream.next()
        stream, _ = await engine.submit(lambda e: (e.add_request([7, 8]), None))
        while not (await stream.next()).finished:  # type: ignore[union-attr]
            pass

    try:
        asyncio.run(main())
        assert engine.running and engine.restarts == 1
        engine.call_blocking(lambda e: e.check_invariants(), timeout=30)
    finally:
        engine.shutdown()
