"""The sliding-window pool in view: `Engine.snapshot()`, ``/metrics``, ``/health`` and
`kvpilot top`, read from a real engine on the hybrid checkpoints of tests/window_models.py
(W = 32 tokens, block size 8)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from window_models import GREEDY, WINDOW, build_hybrid, long_prompts, window_engine

from kvpilot.engine import Engine
from kvpilot.memory.window import first_needed, max_held_blocks
from kvpilot.model.runner import ModelRunner
from kvpilot.server.metrics import ServerMetrics
from kvpilot.server.tiers import window_kv
from kvpilot.top import view
from kvpilot.top.sample import Sample, parse_metrics
from kvpilot.units import format_bytes

B = 8
POOL = 40  # window blocks, the null block included


@pytest.fixture(scope="module", params=["mistral", "qwen3"])
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hybrid(request.param, tmp_path_factory.mktemp("hybrid"))


def window_block_bytes(engine: Engine) -> int:
    """One window block by hand: K and V of B tokens in every windowed layer, in fp32."""
    runner = engine.executor
    assert isinstance(runner, ModelRunner)
    c = runner.config
    windowed = sum(1 for i in range(c.num_layers) if c.layer_window(i) is not None)
    return 2 * windowed * c.num_kv_heads * B * c.head_dim * 4


def test_snapshot_counts_the_window_pool_and_what_release_saves(hybrid: Path) -> None:
    engine = window_engine(hybrid, window_kv_blocks=POOL, max_prefill_chunk=32)
    prompt = long_prompts(1, seed=21, lo=6 * WINDOW, hi=6 * WINDOW)[0]
    rid = engine.add_request(prompt, GREEDY)
    traj = engine.requests[rid].seqs[0].traj
    seen_release = False
    while engine.has_unfinished():
        engine.step()
        snap = engine.snapshot()
        w = snap.window
        assert w is not None and w.window_tokens == WINDOW and w.num_blocks == POOL - 1
        if traj.closed:
            continue
        lo = first_needed(traj.num_computed_tokens, WINDOW, B)
        assert w.released_blocks == lo
        assert w.saved_bytes == lo * window_block_bytes(engine)
        assert w.held_blocks == len(traj.block_table) - lo <= max_held_blocks(WINDOW, B) + 1
        assert w.used_blocks == w.held_blocks + (w.used_blocks - w.held_blocks)
        seen_release |= lo > 0
    assert seen_release
    done = engine.snapshot().window
    assert done is not None
    # Finished: nothing held or released; the full blocks of its last window stay cached.
    assert done.held_blocks == 0 and done.released_blocks == 0
    assert done.cached_blocks > 0 and done.used_blocks == done.cached_blocks
    assert done.free_blocks == POOL - 1 - done.cached_blocks


def test_metrics_health_and_top_show_the_window_pool(hybrid: Path) -> None:
    engine = window_engine(hybrid, window_kv_blocks=POOL, max_prefill_chunk=32)
    for prompt in long_prompts(2, seed=22):
        engine.add_request(prompt, GREEDY)
    for _ in range(6):  # mid-prefill: both sequences past their first window
        engine.step()
    metrics = ServerMetrics(block_size=B)
    metrics.observe(engine)
    snap = metrics.latest
    w = snap.window
    assert w is not None and w.released_blocks > 0 and w.held_blocks > 0
    exported = parse_metrics(metrics.render().decode())

    def blocks(state: str) -> float:
        return exported["kvpilot_window_kv_blocks"][(("state", state),)]

    assert blocks("total") == POOL - 1
    assert (blocks("used"), blocks("held")) == (w.used_blocks, w.held_blocks)
    assert (blocks("cached"), blocks("free")) == (w.cached_blocks, w.free_blocks)
    assert exported["kvpilot_window_tokens"][()] == WINDOW
    assert exported["kvpilot_window_kv_released_blocks"][()] == w.released_blocks
    assert exported["kvpilot_window_kv_saved_bytes"][()] == (
        w.released_blocks * window_block_bytes(engine)
    )
    assert exported["kvpilot_window_kv_usage_ratio"][()] == pytest.approx(w.used_blocks / 39)
    health = window_kv(snap)
    assert health is not None and health["held"] == w.held_blocks
    assert health["saved_bytes"] == w.saved_bytes
    console = Console(record=True, width=100)
    console.print(view._memory(Sample(at=0.0, metrics=exported)))
    text = console.export_text()
    assert f"window ({WINDOW} tok)" in text
    assert f"{w.held_blocks} / {POOL - 1}" in text
    assert f"saves {format_bytes(w.saved_bytes)} vs full attention" in text


def test_a_model_without_windows_exports_an_empty_window_pool() -> None:
    engine = Engine.from_pretrained("tiny", kv_blocks=32, block_size=8)
    engine.generate([[5, 6, 7, 8, 9]], GREEDY)
    assert engine.snapshot().window is None
    metrics = ServerMetrics(block_size=8)
    metrics.observe(engine)
    exported = parse_metrics(metrics.render().decode())
    window = {name: v for name, v in exported.items() if name.startswith("kvpilot_window")}
    assert len(window) == 5 and all(x == 0 for v in window.values() for x in v.values())
    assert window_kv(metrics.latest) is None
    console = Console(record=True, width=100)
    console.print(view._memory(Sample(at=0.0, metrics=exported)))
    assert "window" not in console.export_text()
