"""`kvpilot serve`'s start-up banner: each loading step as it starts, then what is served.

Logged line by line while the server starts, before it accepts requests, so a person (or
`kvpilot demo`, which shows the child server's log) always sees what it is waiting for:

    kvpilot serve: model tiny on cpu (float32)
    PyTorch 2.13.0+cpu loaded in 4.1 s
    model: building the built-in tiny model (first use) in ~/.cache/kvpilot/models/tiny-v1
    loading the tokenizer
    loading weights: 13.1 MB  [a progress bar on a terminal; 25% steps in a log]
    KV pool: 256 blocks of 16 tokens (4,096 tokens), 16.8 MB on cpu
    host tier: 256 blocks, 16.8 MB, link 338 MB/s (measured)
    disk tier: 4,096 blocks (268 MB) in /tmp/kv, 344 MB/s (measured)
    pause policy: breakeven: retain, offload or drop each pause by the break-even rule ...
    admission: new work while device KV use is under tau_high 0.90; 128 sequences at most
    ready in 9.8 s: http://127.0.0.1:8000 (OpenAI API under /v1, /metrics, /health)

`StartupBanner` is also the `kvpilot.model.loader.LoadProgress` the model loader reports to.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpilot.units import format_bytes, format_rate, format_seconds

if TYPE_CHECKING:
    from kvpilot.engine import Engine

WEIGHT_STEPS = (0.25, 0.5, 0.75)  # fractions logged when no terminal shows a bar


class StartupBanner:
    def __init__(self, log: logging.Logger | None = None, *, bar: bool | None = None) -> None:
        self.log = log or logging.getLogger("kvpilot.serve")
        self.started = time.monotonic()
        self.bar = sys.stderr.isatty() if bar is None else bar
        self._progress: Any = None
        self._task: Any = None
        self._weights_started = 0.0
        self._weights_announced = False
        self._weights_logged = 0.0  # the last fraction logged, without a bar
        self._weights_done = False

    def say(self, message: str) -> None:
        self.log.info(message)

    # -- before the engine exists -----------------------------------------------------

    def starting(self, model: str, device: str | None, dtype: str | None) -> None:
        self.say(f"kvpilot serve: model {model} on {device or 'cpu'} ({dtype or 'float32'})")

    def runtime(self) -> None:
        """Load PyTorch now (the longest import), saying so, and report its version."""
        began = time.monotonic()
        self.say("loading PyTorch")
        import torch

        cuda = f", {torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else ""
        took = format_seconds(time.monotonic() - began)
        self.say(f"PyTorch {torch.__version__} loaded in {took}{cuda}")

    def model_source(self, model: str) -> None:
        """Where the checkpoint comes from; the built-in tiny model is built on first use."""
        if model != "tiny":
            self.say(f"model: {Path(model).expanduser().resolve()}")
            return
        from kvpilot.model.tiny import DEFAULT_CACHE_DIR, TINY_NAME

        folder = DEFAULT_CACHE_DIR / TINY_NAME
        if (folder.expanduser() / "config.json").is_file():
            self.say(f"model: the built-in tiny model in {folder}")
        else:
            self.say(f"model: building the built-in tiny model (first use) in {folder}")

    # -- kvpilot.model.loader.LoadProgress ----------------------------------------------

    def step(self, what: str) -> None:
        self._stop_bar()
        if what == "tokenizer":
            self.say("loading the tokenizer")
        elif what == "weights":
            self._weights_started = time.monotonic()
        elif what == "kv_pool":
            self.say("allocating the KV pool")

    def weights(self, done_bytes: int, total_bytes: int) -> None:
        if self._weights_done:
            return
        if not self._weights_started:
            self._weights_started = time.monotonic()
        if not self._weights_announced:
            self._weights_announced = True
            self.say(f"loading weights: {format_bytes(total_bytes)}")
            if self.bar:
                self._start_bar(total_bytes)
        fraction = done_bytes / total_bytes if total_bytes else 1.0
        if self._progress is not None:
            self._progress.update(self._task, completed=done_bytes)
        else:
            for mark in WEIGHT_STEPS:
                if self._weights_logged < mark <= fraction < 1.0:
                    self.say(f"loading weights: {mark:.0%}")
                    self._weights_logged = mark
        if done_bytes >= total_bytes:
            self._weights_done = True
            self._stop_bar()
            took = time.monotonic() - self._weights_started
            speed = f" ({format_rate(total_bytes / took)})" if took > 0.05 else ""
            self.say(f"weights loaded in {format_seconds(took)}{speed}")

    def _start_bar(self, total_bytes: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

        self._progress = Progress(
            "  loading weights",
            BarColumn(),
            DownloadColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._task = self._progress.add_task("weights", total=total_bytes)
        self._progress.start()

    def _stop_bar(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    # -- once the engine is built ---------------------------------------------------------

    def engine_ready(self, engine: Engine) -> None:
        from kvpilot.policy.pause import POLICY_SUMMARIES
        from kvpilot.server.tiers import describe_tiers

        tiers = describe_tiers(engine.snapshot())
        config = engine.config
        device_name = getattr(engine.executor, "device", None) or config.runner.device or "cpu"
        device = tiers["device"]
        blocks, block_size = device["blocks"], device["block_size"]
        block_bytes = int(getattr(engine.executor, "kv_bytes_per_block", 0))
        size = f", {format_bytes(blocks * block_bytes)}" if block_bytes else ""
        degree = int(getattr(engine.executor, "degree", 1))
        ranks = (
            f" over {degree} tensor-parallel ranks (each its KV heads' share)" if degree > 1 else ""
        )
        self.say(
            f"KV pool: {blocks:,} blocks of {block_size} tokens ({blocks * block_size:,} "
            f"tokens){size} on {device_name}{ranks}"
        )
        host = tiers["host"]
        if host["enabled"]:
            self.say(
                f"host tier: {host['blocks']:,} blocks, {format_bytes(host['bytes'])}, "
                f"link {format_rate(host['link_bw_bytes_s'])} (measured)"
            )
        else:
            self.say("host tier: none (--host-memory adds one)")
        disk = tiers["disk"]
        if disk["enabled"]:
            capacity = f" ({format_bytes(disk['blocks'] * block_bytes)})" if block_bytes else ""
            self.say(
                f"disk tier: {disk['blocks']:,} blocks{capacity} in {disk['dir']}, "
                f"{format_rate(disk['bw_bytes_s'])} (measured)"
            )
        else:
            self.say("disk tier: none (--disk-dir adds one)")
        policy = tiers["policy"]
        self.say(f"pause policy: {policy}: {POLICY_SUMMARIES.get(policy, '')}".rstrip(": "))
        sched = config.scheduler
        self.say(
            f"admission: new work while device KV use is under tau_high {sched.tau_high:.2f}; "
            f"{sched.max_num_seqs:,} sequences at most, context {engine.max_model_len:,} tokens"
        )

    def listening(self, url: str) -> None:
        took = format_seconds(time.monotonic() - self.started)
        self.say(f"ready in {took}: {url} (OpenAI API under /v1, /metrics, /health)")
        self.say(f"watch it live: kvpilot top --url {url}")
