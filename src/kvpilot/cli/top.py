"""``kvpilot top``: watch a running ``kvpilot serve`` live (KV per tier, sessions, pauses)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    import httpx
    from rich.console import RenderableType


def top(
    url: Annotated[str, typer.Option(help="The server to watch.")] = "http://127.0.0.1:8000",
    api_key: Annotated[
        str | None, typer.Option(help="API key, when the server was started with --api-keys.")
    ] = None,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 1.0,
    iterations: Annotated[
        int, typer.Option(help="Refresh this many times, then exit (0: until Ctrl-C).")
    ] = 0,
    pauses: Annotated[int, typer.Option(help="Last pause decisions shown.")] = 6,
) -> None:
    """Watch a running server live: KV per tier against tau_high, sessions, pauses and why.

    Refreshes every --interval seconds from the server's /metrics, /health and
    /v1/sessions: KV use per tier, running/waiting/paused sessions, the prefix hit rate now
    and overall against an unbounded cache's, prefetch hits and stalls, bytes moved between
    tiers, and the last pause decisions with their reasons.
    """
    import httpx
    from rich.console import Console
    from rich.live import Live

    if interval <= 0:
        _fail("--interval must be positive, e.g. 1 or 0.5")
    if iterations < 0:
        _fail("--iterations must be 0 (until Ctrl-C) or more")
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    console = Console()
    with httpx.Client(base_url=url, headers=headers, timeout=5.0) as client:
        if console.is_terminal and iterations == 0:  # a screen redrawn in place, until Ctrl-C
            with Live(console=console, auto_refresh=False) as screen:
                _watch(client, url, interval, 0, pauses, lambda v: screen.update(v, refresh=True))
        else:  # frames one after another (a pipe, a log, a test)
            _watch(client, url, interval, iterations, pauses, console.print, keep_going=False)


def _watch(
    client: httpx.Client,
    url: str,
    interval: float,
    iterations: int,
    pauses: int,
    show: Callable[[RenderableType], None],
    *,
    keep_going: bool = True,
) -> None:
    """Read the server every ``interval`` and show the view. Rates need two readings, so
    the first view comes after one interval. An unreachable server is shown and retried
    (``keep_going``) or ends the command."""
    import time

    from kvpilot.top.sample import Sample, ServerUnreachable, read_sample
    from kvpilot.top.view import render, render_error

    previous: Sample | None = None
    frames = 0
    while iterations == 0 or frames < iterations:
        try:
            current = read_sample(client)
        except ServerUnreachable as exc:
            if not keep_going:
                _fail(f"{exc} (is `kvpilot serve` running there?)")
            show(render_error(url, str(exc)))
            previous = None
        else:
            if previous is not None:
                show(render(url, current, previous, max_pauses=pauses))
                frames += 1
            previous = current
        if iterations == 0 or frames < iterations:
            time.sleep(interval)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)
