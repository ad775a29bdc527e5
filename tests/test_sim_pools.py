"""The simulator sizes a hybrid model's pools with the plan's per-layer arithmetic: a main
pool for the full-attention layers and a window pool for the sliding-window layers, holding
as many sequences of the model's longest context as `kvpilot plan` counts.

Configs and hand-worked plan figures: tests/test_plan_hybrid.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_plan_hybrid import GEMMA_2_9B, H100, H200, MISTRAL_7B_V01, QWEN3_MIXED
from typer.testing import CliRunner

from kvpilot.cli import app
from kvpilot.engine.config import EngineConfig
from kvpilot.sim.build import SimSetup, build_engine, kv_pool_blocks
from kvpilot.sim.drivers import AgentDriver
from kvpilot.sim.pools import sim_pools
from kvpilot.sim.simulator import Simulator
from kvpilot.sim.window_runner import WindowedSimulatedRunner
from kvpilot.sim.workload import WorkloadConfig
from kvpilot.sizing.geometry import resolve_geometry
from kvpilot.sizing.hardware import parse_node
from kvpilot.sizing.plan import PlanConfig, make_plan

PER_SEQ = 4096 // 16 + 2  # window blocks a running sequence holds at most (W = 4,096, B = 16)


def config_dir(tmp_path: Path, name: str, config: dict[str, Any]) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_gemma_2_pools_hold_the_plans_sequences_at_8k(tmp_path: Path) -> None:
    setup = SimSetup(
        model=str(config_dir(tmp_path, "gemma-2-9b", GEMMA_2_9B)),
        node="1xh100",
        tp=1,
        host_kv_bytes_per_device=0,
    )
    pools = sim_pools(setup)
    assert pools.window is not None and pools.window.window_tokens == 4096
    block = 16 * 21 * 8192  # 21 layers of 8 KiB per token, in each group
    assert pools.main_block_bytes == pools.window.block_bytes == block == 2_752_512
    plan = make_plan(PlanConfig(setup.geometry(), parse_node("1xh100"), tp=1, contexts=(8192,)))
    pool = H100 - 18_483_411_968 - 2.5e9
    assert plan.budget.pool_bytes_per_device == pytest.approx(pool)
    # 8,192 tokens: 512 main blocks and 258 window blocks each; 30 fit (the plan's 30).
    assert plan.capacity[0].cold == 30
    assert pools.window.num_blocks == 30 * PER_SEQ + 2048 // 16 + 1 == 7869
    assert pools.main_blocks == int((pool - 7869 * block) // block) == 15715
    assert pools.main_blocks // 512 == 30
    assert (pools.main_blocks * block + pools.window.num_blocks * block) <= pool
    # One pool of every layer (equation 1, as before) held 23.
    one_pool = kv_pool_blocks(setup.geometry(), parse_node("1xh100"), 1)
    assert one_pool // 512 == 23
    engine, _ = build_engine(setup, 32000)
    assert isinstance(engine.executor, WindowedSimulatedRunner)
    assert engine.kv.device.num_blocks == 15715
    assert engine.kv.window is not None and engine.kv.window.num_blocks == 7868
    assert not any("one pool" in w for w in setup.warnings())


def test_qwen3_mixed_layers_hold_the_plans_25_at_128k(tmp_path: Path) -> None:
    setup = SimSetup(
        model=str(config_dir(tmp_path, "qwen3-mixed", QWEN3_MIXED)),
        node="1xh200",
        tp=1,
        host_kv_bytes_per_device=0,
    )
    pools = sim_pools(setup)
    assert pools.window is not None
    assert pools.main_block_bytes == 16 * 9 * 4096 and pools.window.block_bytes == 16 * 27 * 4096
    plan = make_plan(PlanConfig(setup.geometry(), parse_node("1xh200"), tp=1, contexts=(131072,)))
    assert plan.capacity[0].cold == 25
    pool = H200 - 2 * 8_190_735_360 - 2.5e9
    assert pools.window.num_blocks == 25 * PER_SEQ + 128 + 1
    assert pools.main_blocks == int((pool - 6579 * 16 * 27 * 4096) // (16 * 9 * 4096))
    assert pools.main_blocks // (131072 // 16) == 25


def test_mistral_window_pool_holds_the_plans_windows_less_the_growing_blocks(
    tmp_path: Path,
) -> None:
    model = str(config_dir(tmp_path, "mistral-7b-v0.1", MISTRAL_7B_V01))
    setup = SimSetup(model=model, node="1xh100", tp=1, host_kv_bytes_per_device=0)
    pools = sim_pools(setup)
    assert pools.window is not None and pools.main_block_bytes == 0
    plan = make_plan(PlanConfig(setup.geometry(), parse_node("1xh100"), tp=1, contexts=(32768,)))
    assert plan.capacity[0].cold == 128  # 4,096 tokens (256 blocks) of every layer each
    block = 16 * 32 * 4096
    today = int((H100 - 2 * 7_241_732_096 - 2.5e9) // block)
    assert pools.window.num_blocks == today + 1 == 32862
    # The engine keeps two blocks more per sequence (its growing block and a partial one).
    assert (pools.window.num_blocks - 1) // PER_SEQ == 127
    assert pools.main_blocks >= 127 * (32768 // 16)  # main blocks cost nothing here
    # With a host tier, the real engine keeps every layer in one pool: so does the simulator.
    tiered = SimSetup(model=model, node="1xh100", tp=1)
    assert sim_pools(tiered).window is None
    assert any("one pool" in w for w in tiered.warnings())


def test_a_hybrid_simulation_releases_window_blocks_and_stays_consistent(
    tmp_path: Path,
) -> None:
    small = {**GEMMA_2_9B, "sliding_window": 256}
    setup = SimSetup(
        model=str(config_dir(tmp_path, "gemma-2-w256", small)),
        node="1xh100",
        tp=1,
        kv_blocks=600,
        host_kv_bytes_per_device=0,
        duration_s=60.0,
        engine=EngineConfig.from_kwargs(max_num_seqs=16, max_num_batched_tokens=1024),
    )
    engine, _ = build_engine(setup, 32000)
    assert engine.kv.window is not None and engine.kv.window.num_blocks == 600
    wl = WorkloadConfig.from_dict(
        {
            "arrival": {"concurrent": 6, "ramp_s": 0},
            "trajectory": {
                "turns": 3,
                "task_tokens": 900,
                "observation_tokens": 300,
                "output_tokens": 40,
            },
            "shared_prefix": {"system_tokens": 64, "tool_tokens": 64},
            "tools": {"bash": {"weight": 1, "wait": 1.0}},
            "branching": {"probability": 0},
        }
    )
    sim = Simulator(engine, duration_s=60.0)
    original = engine.step
    released = 0

    def checked_step(**kwargs: Any) -> Any:
        nonlocal released
        out = original(**kwargs)
        engine.check_invariants()
        window = engine.snapshot().window
        assert window is not None
        released = max(released, window.released_blocks)
        return out

    engine.step = checked_step  # type: ignore[method-assign]
    sim.run(AgentDriver(wl, engine.max_model_len))
    assert sim.turns.prompt_tokens and released > 0


@pytest.mark.parametrize(
    ("name", "config", "node", "context"),
    [
        ("gemma-2-9b", GEMMA_2_9B, "1xh100", 8192),
        ("qwen3-mixed", QWEN3_MIXED, "1xh200", 131072),
        ("mistral-7b-v0.1", MISTRAL_7B_V01, "1xh100", 32768),
    ],
)
def test_plan_and_simulator_split_the_pools_alike(
    tmp_path: Path, name: str, config: dict[str, Any], node: str, context: int
) -> None:
    model = config_dir(tmp_path, name, config)
    setup = SimSetup(model=str(model), node=node, tp=1, host_kv_bytes_per_device=0)
    pools = sim_pools(setup)
    assert pools.window is not None
    plan = make_plan(PlanConfig(setup.geometry(), parse_node(node), tp=1, contexts=(context,)))
    (row,) = plan.pools
    assert (row.main_blocks, row.window_blocks) == (pools.main_blocks, pools.window.num_blocks)
    assert (row.main_block_bytes, row.window_block_bytes) == (
        pools.main_block_bytes,
        pools.window.block_bytes,
    )
    # The pools hold the plan's cold capacity at the longest context, less at most one
    # sequence (the engine keeps two blocks more per window than W tokens).
    cold = plan.capacity[0].cold
    assert cold - 1 <= row.longest_seqs <= cold
    shown = CliRunner().invoke(app, ["plan", "--model", str(model), "--node", node, "--tp", "1"])
    assert shown.exit_code == 0 and "Hybrid pools per device" in shown.output
    assert f"{row.window_blocks:,}" in shown.output


def test_a_full_attention_plan_has_no_hybrid_pools() -> None:
    assert make_plan(PlanConfig(resolve_geometry("llama-3-8b"), parse_node("1xh100"))).pools == ()
    shown = CliRunner().invoke(app, ["plan", "--model", "llama-3-8b", "--node", "1xh100"])
    assert shown.exit_code == 0 and "Hybrid pools" not in shown.output
