"""Configuration per component, the flat keyword names mapped onto it, and fields an executor
cannot honour refused rather than ignored."""

from __future__ import annotations

import dataclasses

import pytest

from kvpilot.engine import Engine, VirtualClock
from kvpilot.engine.config import (
    FLAT_OPTIONS,
    EngineConfig,
    PauseConfig,
    RunnerConfig,
    SchedulerConfig,
    TierConfig,
)
from kvpilot.errors import ConfigError
from kvpilot.sim.build import SimSetup

from fake_executor import FakeExecutor


def test_flat_names_land_in_their_component() -> None:
    config = EngineConfig.from_kwargs(
        block_size=8,
        kv_blocks=64,
        tau_high=0.7,
        max_num_batched_tokens=256,
        pause_policy="drop",
        pause_ttl_s=3.0,
        host_memory_bytes=1 << 20,
        disk_dir="/tmp/kv",
        max_model_len=1024,
        seed=7,
    )
    assert config.runner == RunnerConfig(
        block_size=8,
        kv_blocks=64,
        tiers=TierConfig(host_memory_bytes=1 << 20, disk_dir="/tmp/kv"),
    )
    assert config.scheduler == SchedulerConfig(tau_high=0.7, max_num_batched_tokens=256)
    assert config.pause == PauseConfig(policy="drop", ttl_s=3.0)
    assert (config.max_model_len, config.seed) == (1024, 7)


def test_every_field_of_every_component_has_one_flat_name() -> None:
    leaves = set()
    for path, cls in (
        ("scheduler", SchedulerConfig),
        ("pause", PauseConfig),
        ("runner", RunnerConfig),
        ("runner.tiers", TierConfig),
    ):
        leaves |= {(path, f.name) for f in dataclasses.fields(cls) if f.name != "tiers"}
    leaves |= {("", "max_model_len"), ("", "seed")}
    assert sorted(FLAT_OPTIONS.values()) == sorted(leaves)


def test_flat_round_trip_and_changed_only() -> None:
    config = EngineConfig.from_kwargs(kv_blocks=64, prefetch=False, chunked_prefill=False)
    assert EngineConfig.from_kwargs(**config.flat()) == config
    assert config.flat(changed_only=True) == {
        "kv_blocks": 64,
        "prefetch": False,
        "chunked_prefill": False,
    }
    assert EngineConfig().flat(changed_only=True) == {}


def test_replace_changes_only_what_it_names() -> None:
    base = EngineConfig.from_kwargs(kv_blocks=64, pause_policy="retain")
    changed = base.replace(tau_high=0.5, disk_kv_blocks=8, disk_dir="/tmp/x")
    assert changed.runner.kv_blocks == 64 and changed.pause.policy == "retain"
    assert changed.scheduler.tau_high == 0.5 and changed.runner.tiers.disk_slots == 8
    assert base.scheduler.tau_high == 0.9  # frozen: the original is untouched


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_blockz": 4}, "unknown engine option"),
        ({"tau_high": 1.5}, "tau_high"),
        ({"block_size": 12}, "power of two"),
        ({"pause_policy": "yolo"}, "breakeven"),
        ({"kv_blocks": 4, "kv_memory_bytes": 1 << 20}, "not both"),
        ({"host_kv_blocks": 4, "host_memory_bytes": 1 << 20}, "not both"),
        ({"disk_kv_blocks": 64}, "disk_dir"),
    ],
)
def test_bad_options_are_config_errors(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_kwargs(**options)


def test_from_pretrained_refuses_unknown_flat_names() -> None:
    with pytest.raises(ConfigError, match="unknown engine option"):
        Engine.from_pretrained("tiny", kv_blockz=64)


def engine_on(executor: FakeExecutor, **flat: object) -> Engine:
    return Engine(executor, EngineConfig.from_kwargs(**flat), vocab_size=500, clock=VirtualClock())


def test_unset_runner_fields_take_the_executors() -> None:
    engine = engine_on(FakeExecutor(32, 4))
    assert engine.kv.block_size == 4 and engine.kv.device.num_blocks == 32


@pytest.mark.parametrize(
    ("flat", "message"),
    [
        ({"block_size": 16}, "block_size 16 \\(the executor uses 4\\)"),
        ({"kv_blocks": 64}, "kv_blocks 64 \\(the executor has 32\\)"),
        ({"host_kv_blocks": 8}, "host tier"),
        ({"disk_dir": "/tmp/nowhere"}, "disk tier"),
    ],
)
def test_a_field_the_executor_cannot_honour_is_an_error(
    flat: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        engine_on(FakeExecutor(32, 4), **flat)


def test_matching_runner_fields_are_accepted() -> None:
    engine = engine_on(FakeExecutor(32, 4), block_size=4, kv_blocks=32)
    assert engine.config.runner.block_size == 4


@pytest.mark.parametrize(
    "flat",
    [{"dtype": "bfloat16"}, {"device": "cuda"}, {"attention": "sdpa"}, {"kv_blocks": 10}],
)
def test_the_simulator_refuses_runner_fields_it_cannot_honour(flat: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="simulator cannot honour"):
        SimSetup(engine=EngineConfig.from_kwargs(**flat))


def test_the_simulator_honours_the_block_size() -> None:
    from kvpilot.sim.build import build_engine

    config = EngineConfig.from_kwargs(block_size=32)
    setup = SimSetup(model="llama-3-8b", node="h100", engine=config)
    engine, _ = build_engine(setup, 32000)
    assert engine.kv.block_size == 32 == engine.executor.block_size
