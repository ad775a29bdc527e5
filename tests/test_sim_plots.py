"""Figures say what the tables say: capacity.png is `kvpilot plan`, latency.png keeps colours."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvpilot.cli import app
from kvpilot.sim.build import SimSetup, run_simulation
from kvpilot.sim.plots import capacity_figure, latency_figure
from kvpilot.sim.workload import WorkloadConfig
from kvpilot.sizing.geometry import resolve_geometry
from kvpilot.sizing.hardware import ACCELERATORS, parse_node
from kvpilot.sizing.plan import PlanConfig, make_plan


def bar_heights(fig: object) -> list[float]:
    ax = fig.axes[0]  # type: ignore[attr-defined]
    return [patch.get_height() for patch in ax.patches]


def test_capacity_figure_draws_the_numbers_plan_prints() -> None:
    result = CliRunner().invoke(app, ["plan", "--json", "--model", "llama-3-70b"])
    printed = json.loads(result.output)["capacity"]
    plan = make_plan(PlanConfig(resolve_geometry("llama-3-70b"), parse_node("8xh100")))
    fig = capacity_figure([plan])
    cold = [r["cold"] for r in printed]
    shared = [r["shared"] or 0 for r in printed]
    assert bar_heights(fig) == cold + shared
    title = fig.axes[0].get_title()
    for assumption in ("headroom 0%", "output 0 tokens", "reserve 2.5 GB per device"):
        assert assumption in title
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["8xh100-sxm TP 4 x 2 cold", "8xh100-sxm TP 4 x 2 shared 24,576 tokens"]


def test_latency_panels_draw_each_metric_in_one_colour() -> None:
    wl = WorkloadConfig.from_dict(
        {
            "arrival": {"concurrent": 8, "ramp_s": 0},
            "trajectory": {"turns": 3, "task_tokens": 300, "output_tokens": 40},
            "tools": {"bash": {"weight": 1, "wait": 1.0}},
        }
    )
    result = run_simulation(
        SimSetup(model="llama-3-8b", node="h100", kv_blocks=3000, duration_s=30.0), wl
    )
    fig = latency_figure(result)
    left, right = fig.axes
    colours = [
        {line.get_label(): line.get_color() for line in ax.get_lines()} for ax in (left, right)
    ]
    assert colours[0] == colours[1]
    assert colours[0]["TTFT p50"] == colours[0]["TTFT p99"] != colours[0]["ITL p50"]


@pytest.mark.parametrize(
    "name",
    [
        "a100-40",
        "a100-80",
        "h100-pcie",
        "h100-sxm",
        "h200",
        "h200-nvl",
        "b200",
        "gb200",
        "l40s",
        "mi300x",
        "mi325x",
    ],
)
def test_the_issue_presets_exist_with_their_links(name: str) -> None:
    accel = ACCELERATORS[name]
    assert accel.host_link_bw_bytes_s in (32e9, 64e9, 450e9)  # PCIe Gen4/5 x16, NVLink-C2C
    assert accel.peer_link_bw_bytes_s is not None and accel.peer_link
    plan = make_plan(PlanConfig(resolve_geometry("llama-3-8b"), parse_node(f"8x{name}")))
    assert plan.budget.tp == 1 and plan.budget.replicas == 8


def test_l40s_has_no_nvlink_and_mi300x_holds_a_70b_model_on_one_device() -> None:
    assert ACCELERATORS["l40s"].peer_link == "PCIe Gen4 (no NVLink)"
    plan = make_plan(PlanConfig(resolve_geometry("llama-3-70b"), parse_node("8xmi300x")))
    assert (plan.budget.tp, plan.budget.replicas) == (1, 8)
