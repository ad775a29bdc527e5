"""Sizing the KV pool from device memory, and the per-device dtype default."""

from __future__ import annotations

import inspect

import pytest
import torch

from kvpilot.engine.config import EngineConfig
from kvpilot.errors import ConfigError
from kvpilot.model.memory_budget import MIN_ACTIVATION_HEADROOM_BYTES, kv_budget_bytes
from kvpilot.model.runner import ModelRunner, parse_dtype

GIB = 1 << 30


def test_the_pool_gets_the_utilization_share_less_weights_and_headroom() -> None:
    total = 80 * GIB
    budget = kv_budget_bytes(total=total, free=70 * GIB, held_by_us=10 * GIB, utilization=0.9)
    headroom = int(total * 0.02)
    assert budget == int(total * 0.9) - 10 * GIB - headroom


def test_the_pool_never_takes_more_than_is_free() -> None:
    budget = kv_budget_bytes(total=80 * GIB, free=20 * GIB, held_by_us=GIB, utilization=0.9)
    assert budget == 20 * GIB - int(80 * GIB * 0.02)


def test_small_devices_keep_a_minimum_activation_headroom() -> None:
    budget = kv_budget_bytes(total=8 * GIB, free=8 * GIB, held_by_us=0, utilization=1.0)
    assert budget == 8 * GIB - MIN_ACTIVATION_HEADROOM_BYTES


def test_no_room_left_is_a_config_error_that_says_what_to_change() -> None:
    with pytest.raises(ConfigError, match="gpu-memory-utilization"):
        kv_budget_bytes(total=16 * GIB, free=GIB, held_by_us=15 * GIB, utilization=0.9)
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        kv_budget_bytes(total=16 * GIB, free=GIB, held_by_us=0, utilization=1.5)
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig.from_kwargs(gpu_memory_utilization=0.0)


def test_auto_dtype_is_bfloat16_on_cuda_and_float32_on_cpu() -> None:
    assert parse_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert parse_dtype("auto", torch.device("cpu")) == torch.float32
    assert parse_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    # Unset in the config, the model builder leaves it to the runner, whose default is auto.
    assert EngineConfig().runner.dtype is None
    assert inspect.signature(ModelRunner).parameters["dtype"].default == "auto"
    with pytest.raises(ConfigError, match="auto, float32"):
        parse_dtype("float8")
