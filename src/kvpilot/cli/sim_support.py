"""What `kvpilot sim` and `kvpilot calibrate` share: trace paths, replay limits, progress,
figures. Cheap to import (rich, numpy and matplotlib load inside the functions)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpilot.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

MINISWE_RELATIVE = Path("traces") / "lmcache-agent-trace" / "miniswe"

# Help texts of the replay limits, the same on both commands.
HELP_SESSIONS = "Replay: at most N sessions."
HELP_CALLS = "Replay: at most N calls per session."
HELP_MAX_CALL_TOKENS = "Replay: a session ends at its first call longer than N tokens."
HELP_HEAD_TOKENS = "Replay: cut the prefix all of a session's calls share to N tokens."
HELP_MAX_OUTPUT_TOKENS = "Replay: generate at most N tokens per call."


def default_miniswe_dir() -> Path | None:
    """``../shared/traces/lmcache-agent-trace/miniswe`` next to the repository, if present."""
    root = Path(__file__).resolve().parents[3]
    for base in (root.parent / "shared", root / "shared"):
        if (base / MINISWE_RELATIVE).is_dir():
            return base / MINISWE_RELATIVE
    return None


def resolve_trace_paths(paths: list[str]) -> list[Path]:
    out = []
    for p in paths:
        if p.lower() == "miniswe":
            found = default_miniswe_dir()
            if found is None:
                raise ConfigError(
                    "no miniswe traces next to the repository (../shared/traces/"
                    "lmcache-agent-trace/miniswe); give the folder's path instead"
                )
            out.append(found)
        else:
            out.append(Path(p))
    return out


def tokenizer_from(path: str | None) -> Callable[[str], list[int]] | None:
    if path is None:
        return None
    from kvpilot.sim.calibrate import tokenizer_of

    return tokenizer_of(path)


def jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


class progress:
    """A rich progress bar over simulated seconds (a no-op when quiet)."""

    def __init__(self, console: Console, total_s: float, label: str, quiet: bool) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.quiet = quiet
        self.total = total_s
        self.bar = Progress(
            TextColumn(f"[bold]sim {label}"),
            BarColumn(),
            TextColumn("{task.completed:,.0f}/{task.total:,.0f} s simulated"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self.task = self.bar.add_task(label, total=total_s)

    def __enter__(self) -> Any:
        if self.quiet:
            return None
        self.bar.start()
        return lambda now: self.bar.update(self.task, completed=min(now, self.total))

    def __exit__(self, *exc: object) -> None:
        if not self.quiet:
            self.bar.stop()


def write_figures(out: Path, setup: Any, results: list[Any], console: Console) -> None:
    """PNG figures and summary.json of ``results``. capacity.png is `kvpilot plan`'s table
    for the simulated model and node (its default shared prefix and contexts, the run's TP
    and reserve), so the figure and the table always agree."""
    from kvpilot.sim import plots
    from kvpilot.sizing.plan import PlanConfig, make_plan

    out.mkdir(parents=True, exist_ok=True)
    first = results[0]
    written = [
        plots.plot_kv_usage(first, out / "kv_usage.png", setup.engine.scheduler.tau_high),
        plots.plot_latency(first, out / "latency.png"),
    ]
    if len(results) > 1:
        written.append(plots.plot_policy_comparison(results, out / "policies.png"))
        for r in results[1:]:
            written.append(
                plots.plot_kv_usage(
                    r, out / f"kv_usage-{r.label}.png", setup.engine.scheduler.tau_high
                )
            )
    if setup.profile is None:
        geometry, node_obj, tp = setup.geometry(), setup.parsed_node(), setup.tp_degree()
        written.append(plots.plot_breakeven(geometry, node_obj, tp, out / "breakeven.png"))
        plan = make_plan(
            PlanConfig(
                geometry, node_obj, tp=tp, reserve_bytes_per_device=setup.reserve_bytes_per_device
            )
        )
        peak = float(first.samples["resident"].max()) if len(first.samples["resident"]) else 0.0
        observed = {f"sim peak holding KV ({first.label}, one replica)": peak} if peak else None
        written.append(plots.plot_capacity([plan], out / "capacity.png", observed=observed))
    (out / "summary.json").write_text(
        json.dumps([r.summary() for r in results], indent=2, default=jsonable) + "\n"
    )
    for path in written:
        console.print(f"wrote {path}")
