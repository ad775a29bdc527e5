"""`kvpilot sim --replicas R --router NAME` (and ``--compare-routers``): the fleet mode of
`kvpilot sim`, called from `kvpilot.cli.sim` once the single-engine options are parsed."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from kvpilot.errors import ConfigError
from kvpilot.fleet.routers import ROUTER_NAMES
from kvpilot.fleet.scoring import RouterConfig
from kvpilot.fleet.sim_report import FleetResult, plot_router_comparison, print_fleet_results
from kvpilot.fleet.sim_run import run_fleet
from kvpilot.sim.build import SimSetup


def run_fleet_cli(
    setup: SimSetup,
    workload: Any,
    *,
    replicas: int,
    router: str,
    compare_routers: bool,
    routers: str | None,
    config: RouterConfig,
    event_delay_s: float,
    families: int,
    family_skew: float,
    policy: str,
    time_scale: float,
    vocab_size: int,
    out: Path | None,
    as_json: bool,
    console: Console,
) -> None:
    names = [router]
    if compare_routers:
        chosen = routers.split(",") if routers else list(ROUTER_NAMES)
        names = list(dict.fromkeys([router, *(r.strip() for r in chosen if r.strip())]))
    for name in names:
        if name not in ROUTER_NAMES:
            raise ConfigError(f"--router {name!r} is unknown; known: {', '.join(ROUTER_NAMES)}")
    results: list[FleetResult] = []
    for name in names:
        with console.status(f"simulating {replicas} replicas behind {name}", spinner="dots"):
            results.append(
                run_fleet(
                    setup,
                    workload,
                    replicas=replicas,
                    router=name,
                    config=config,
                    event_delay_s=event_delay_s,
                    families=families,
                    family_skew=family_skew,
                    policy=policy,
                    time_scale=time_scale,
                    vocab_size=vocab_size,
                )
            )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "fleet.json").write_text(json.dumps(summaries(results), indent=2) + "\n")
        if len(results) > 1:
            path = plot_router_comparison(results, out / "routers.png")
            console.print(f"wrote {path}")
    if as_json:
        payload: Any = summaries(results)
        print(json.dumps(payload[0] if len(payload) == 1 else payload))
        return
    print_fleet_results(console, results)


def summaries(results: Sequence[FleetResult]) -> list[dict[str, Any]]:
    return [
        {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.summary().items()}
        for r in results
    ]
