"""`kvpilot demo`: agent sessions against a real `kvpilot serve`, pausing on tool calls.

After the sizing part (`kvpilot plan`, `kvpilot frag`, run by the CLI), this starts
``kvpilot serve`` with the built-in ``tiny`` model in a child process: a device KV pool small
enough that paused sessions compete for it, a host tier, a disk tier in a temporary folder,
and the break-even pause policy. An agent-style client (`kvpilot.demo.client`) replays a few
recorded miniswe sessions through it, each turn sent as the new part of the session with
the coming tool call and its wait. Every turn prints its cached tokens (and the tier they
came back from) and the pause decision with its reason; a summary compares the hit rate
with the ideal one and shows what the tiers did. Then every resumed turn is recomputed from
its tokens with nothing cached (the server poisons freed KV blocks, so a stale read would
show): the summary counts the mismatches, which must be 0. The server is always stopped at
the end, on an error or Ctrl-C too.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvpilot.demo.client import (
    TIERS,
    AgentClient,
    AgentScript,
    ScriptBudget,
    TurnResult,
    Verification,
    ideal_hit_rate_of,
    load_scripts,
)
from kvpilot.errors import ConfigError, KvpilotError
from kvpilot.policy.breakeven import PauseAction, action_label
from kvpilot.server.process import ServeProcess
from kvpilot.units import format_byte_seconds, format_bytes, format_seconds

TRACE_DIR = Path("shared/traces/lmcache-agent-trace/miniswe")
DIRECTIONS = ("device_to_host", "host_to_device", "device_to_disk", "disk_to_device")


def default_trace_dir() -> Path | None:
    """``../shared/traces/...`` next to the repository (from the working directory or from
    this checkout), if it is there."""
    repo = Path(__file__).resolve().parents[3]
    for base in (Path.cwd().parent, repo.parent):
        if (base / TRACE_DIR).is_dir():
            return base / TRACE_DIR
    return None


class DemoError(KvpilotError):
    """The replay failed against a running server; the message ends with the server's log."""


@dataclass(frozen=True, slots=True)
class DemoConfig:
    budget: ScriptBudget = field(default_factory=ScriptBudget)
    max_tokens: int = 16
    kv_blocks: int = 256  # 4,096 tokens of tiny: fewer than three sessions' contexts
    host_memory: str = "16MiB"  # room for about two paused sessions: the third goes to disk
    policy: str = "breakeven"
    trace_dir: Path | None = field(default_factory=default_trace_dir)
    max_model_len: int = 8192
    poison_freed_blocks: bool = True  # a stale KV read shows as a mismatch

    def __post_init__(self) -> None:
        need = self.budget.context_tokens(self.max_tokens)
        if need >= self.max_model_len:
            raise ConfigError(
                f"a session could reach {need} tokens, over the model context of "
                f"{self.max_model_len}: replay fewer turns or clip them shorter"
            )
        if need >= self.kv_blocks * 16:
            raise ConfigError(f"a session of {need} tokens would not fit {self.kv_blocks} blocks")


@dataclass(frozen=True, slots=True)
class DemoSummary:
    sessions: int
    turns: int
    pauses: int  # turns that ended on a tool call
    prompt_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int]
    hit_rate: float
    ideal_hit_rate: float
    decisions: dict[str, int]  # the server's pause decisions by action (and "demoted")
    bytes_moved: dict[str, int]
    prefetch_hits: int
    prefetch_stalls: int
    recomputed_tokens: int
    idle_gb_s: float
    wall_s: float
    server_exit_code: int | None
    recomputed_turns: int  # resumed turns checked against a recompute
    mismatches: int  # of those, how many differed (must be 0)


def run_engine_demo(
    console: Console, model: str = "tiny", config: DemoConfig | None = None
) -> DemoSummary:
    """Serve ``model`` with tiers, replay agent sessions through it, print what happened."""
    config = config or DemoConfig()
    scripts, source = load_scripts(config.trace_dir, config.budget)
    with tempfile.TemporaryDirectory(prefix="kvpilot-demo-") as tmp:
        args = [
            *("--model", model, "--kv-blocks", str(config.kv_blocks)),
            *("--host-memory", config.host_memory, "--disk-dir", str(Path(tmp) / "kv")),
            *("--policy", config.policy, "--max-model-len", str(config.max_model_len)),
            *(["--poison-freed-blocks"] if config.poison_freed_blocks else []),
        ]
        server = ServeProcess(
            args, log_path=Path(tmp) / "serve.log", on_log=lambda line: _banner_line(console, line)
        )
        console.rule(f"[bold]kvpilot serve: {escape(model)} with a host tier and a disk tier")
        console.print(f"$ kvpilot serve {' '.join(args)}", soft_wrap=True)
        start = time.monotonic()
        with console.status("starting kvpilot serve (its start-up log follows)"):
            server.start()
        try:
            tiers = server.health.get("tiers", {})
            block_size = int(tiers.get("device", {}).get("block_size", 16))
            console.rule(
                f"[bold]{len(scripts)} agent sessions, tool waits x{config.budget.time_scale:g}"
            )
            console.print(f"[dim]sessions from {escape(source)}[/]")
            try:
                results = _replay(console, server.base_url, model, scripts, config)
                metrics = _scrape(server.base_url)
                verification = _verify(console, server.base_url, model, results, config)
            except (openai.OpenAIError, httpx.HTTPError) as exc:
                raise DemoError(
                    f"the agent replay failed: {type(exc).__name__}: {exc}\n"
                    f"last lines of the server's log:\n{server.log_tail()}"
                ) from exc
        finally:
            with console.status("stopping kvpilot serve (it closes the engine and disk tier)"):
                server.stop()
        wall = time.monotonic() - start
    summary = _summarize(
        results, metrics, verification, block_size, len(scripts), wall, server.returncode
    )
    console.print(_summary_table(summary))
    if verification.mismatches:
        raise DemoError(
            f"{len(verification.mismatches)} of {verification.checked} resumed turns differ "
            "from a recompute of the same turn: KV was lost or mixed up on the way\n"
            + "\n".join(verification.mismatches)
        )
    return summary


BANNER_LOGGER = "kvpilot.serve: "


def _banner_line(console: Console, line: str) -> None:
    """Show the child server's start-up banner lines (not uvicorn's or access lines)."""
    _, found, message = line.partition(BANNER_LOGGER)
    if found:
        console.print(_hanging("  serve |", escape(message)))


def _hanging(label: str, text: str) -> Table:
    """``label text``, the text's wrapped lines indented under its first."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column()
    grid.add_row(label, text)
    return grid


def _replay(
    console: Console, url: str, model: str, scripts: list[AgentScript], config: DemoConfig
) -> list[TurnResult]:
    total = sum(len(s.turns) for s in scripts)
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    stop = threading.Event()
    with (
        Progress(*columns, console=console) as progress,
        AgentClient(url, model=model, max_tokens=config.max_tokens, stop=stop) as client,
    ):
        task = progress.add_task("turns", total=total)

        def on_turn(r: TurnResult) -> None:
            progress.console.print(_turn_line(r))
            if r.pause is not None:
                tool = f"{escape(r.tool or 'tool')} runs {r.tool_wait_s:.2f} s ·"
                progress.console.print(_hanging(f"   {tool}", _reason(r)))
            progress.advance(task)

        return client.replay(scripts, on_turn)


def _verify(
    console: Console, url: str, model: str, results: list[TurnResult], config: DemoConfig
) -> Verification:
    console.rule("[bold]every resumed turn again, recomputed from its tokens")
    with AgentClient(url, model=model, max_tokens=config.max_tokens) as client:
        verification = client.verify(results)
    for line in verification.mismatches:
        console.print(f"[red]mismatch[/] {escape(line)}")
    console.print(
        f"{verification.checked} resumed turns recomputed from their tokens: "
        f"{len(verification.mismatches)} mismatches"
    )
    return verification


def _turn_line(r: TurnResult) -> str:
    tiers = " · ".join(f"{t} {r.cached_by_tier[t]:,}" for t in TIERS if r.cached_by_tier[t])
    line = (
        f"[cyan]{escape(r.script)}[/] turn {r.turn + 1}: {r.prompt_tokens:,} prompt tokens, "
        f"{r.cached_tokens:,} cached{f' ({tiers})' if tiers else ''}, "
        f"{format_seconds(r.latency_s)}"
    )
    return line if r.pause is not None else line + " [dim]· done[/]"


def _reason(r: TurnResult) -> str:
    """The pause reason, its leading decision in bold."""
    reason = escape(r.pause_reason or "")
    try:
        label = PauseAction(r.pause_action or "").label
    except ValueError:
        return reason
    if reason.startswith(label):
        return f"[bold]{label}[/][dim]{reason[len(label) :]}[/]"
    return f"[bold]{escape(label)}[/] [dim]{reason}[/]"


def _scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = next(iter(sample.labels.values()), "")
            values[f"{sample.name}:{label}" if label else sample.name] = sample.value
    return values


def _summarize(
    results: list[TurnResult],
    metrics: dict[str, float],
    verification: Verification,
    block_size: int,
    sessions: int,
    wall_s: float,
    exit_code: int | None,
) -> DemoSummary:
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    by_tier: Counter[str] = Counter()
    for r in results:
        by_tier.update(r.cached_by_tier)
    prefix = "kvpilot_pause_decisions_total:"
    decisions = {
        k.removeprefix(prefix): int(v) for k, v in metrics.items() if k.startswith(prefix) and v
    }
    return DemoSummary(
        sessions=sessions,
        turns=len(results),
        pauses=sum(r.pause is not None for r in results),
        prompt_tokens=prompt,
        cached_tokens=cached,
        cached_by_tier={t: by_tier[t] for t in TIERS},
        hit_rate=cached / prompt if prompt else 0.0,
        ideal_hit_rate=ideal_hit_rate_of(results, block_size),
        decisions=decisions,
        bytes_moved={
            d: int(metrics.get(f"kvpilot_kv_bytes_moved_total:{d}", 0)) for d in DIRECTIONS
        },
        prefetch_hits=int(metrics.get("kvpilot_prefetch_hits_total", 0)),
        prefetch_stalls=int(metrics.get("kvpilot_prefetch_stalls_total", 0)),
        recomputed_tokens=int(metrics.get("kvpilot_recomputed_tokens_total", 0)),
        idle_gb_s=metrics.get("kvpilot_idle_kv_gb_seconds_total", 0.0),
        wall_s=wall_s,
        server_exit_code=exit_code,
        recomputed_turns=verification.checked,
        mismatches=len(verification.mismatches),
    )


def _summary_table(s: DemoSummary) -> Table:
    """Every figure with what it means, and what a good value looks like."""
    table = Table(
        title="kvpilot demo: what happened",
        title_justify="left",
        show_header=False,
        box=box.SIMPLE,
        padding=(0, 1),
    )
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")

    def row(label: str, value: str, note: str = "") -> None:
        table.add_row(label, value + (f"\n[dim]{note}[/]" if note else ""))

    row(
        "sessions · turns · pauses",
        f"{s.sessions} · {s.turns} · {s.pauses}",
        "a pause: a turn that ended on a tool call",
    )
    row(
        "prefix hit rate",
        f"{s.hit_rate:.1%} of {s.prompt_tokens:,} prompt tokens came from cache "
        f"(ideal: {s.ideal_hit_rate:.1%})",
        "ideal: what a cache that never forgets would reuse; good: close to it",
    )
    by_tier = " · ".join(_nbsp(f"{t} {s.cached_by_tier[t]:,}") for t in TIERS)
    row("hits came from", f"{by_tier} tokens")
    decided = [(a, n) for a, n in s.decisions.items() if a != "demoted"]
    row(
        "pause decisions",
        " · ".join(f"{action_label(a)} {n}" for a, n in sorted(decided, key=lambda x: -x[1]))
        or "none",
    )
    row(
        "demotions",
        f"{s.decisions.get('demoted', 0)}",
        "retained sessions' KV moved off the device while they waited, to make room for "
        "running work; good: few (many mean the device pool is small for what is kept)",
    )
    resumes = s.prefetch_hits + s.prefetch_stalls
    row(
        "prefetch hits · stalls",
        f"{s.prefetch_hits} · {s.prefetch_stalls} of {resumes} resumes from host or disk",
        "a hit: the KV was back on the device when the agent returned; a stall: the turn "
        "waited for it to load; good: few stalls (the demo's tool waits, compressed, are "
        "too short for most prefetches)",
    )
    row(
        "KV moved",
        " · ".join(_nbsp(f"{_direction(d)} {format_bytes(n)}") for d, n in s.bytes_moved.items()),
    )
    row(
        "recomputed tokens",
        f"{s.recomputed_tokens:,}",
        "KV computed before, then dropped or lost, and computed again; good: few",
    )
    row(
        "idle device KV",
        format_byte_seconds(s.idle_gb_s * 1e9),
        "device memory held by paused sessions over time (what retaining costs)",
    )
    row(
        "resumed turns vs a recompute",
        f"{s.recomputed_turns} checked, {s.mismatches} mismatches",
        "each resumed turn run again from its tokens with no cache; good: 0 (anything else "
        "means KV was lost or mixed up)",
    )
    stopped = "cleanly" if s.server_exit_code == 0 else f"with status {s.server_exit_code}"
    row("wall time", f"{format_seconds(s.wall_s)} (server stopped {stopped})")
    return table


def _nbsp(text: str) -> str:
    """Keep one figure and its words on one line when the table wraps."""
    return text.replace(" ", "\u00a0")


def _direction(direction: str) -> str:
    return direction.replace("_to_", " → ")
