"""Prometheus metrics: one registry per app, fed from the engine thread.

After every engine iteration the engine thread calls `ServerMetrics.observe`: it moves the
engine's new latency samples into histograms and publishes the engine's own read model
(`Engine.snapshot()`, a frozen `EngineSnapshot`). A scrape and /health read only that
snapshot, so they never race the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpilot.engine import Engine, RequestOutput
from kvpilot.engine.snapshot import SESSION_STATES, EngineSnapshot, WindowPoolUsage
from kvpilot.engine.tier_stats import DIRECTIONS
from kvpilot.policy.breakeven import PauseAction
from kvpilot.trace.ideal import IdealHitMeter

if TYPE_CHECKING:
    from kvpilot.server.submit import Submitted

# Every pause action, and "demoted": idle KV the engine moved out under memory pressure.
PAUSE_ACTIONS = (*(str(a) for a in PauseAction), "demoted")
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class _EngineCollector(Collector):
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        s = self.metrics.latest
        usage = GaugeMetricFamily(
            "kvpilot_kv_usage_ratio", "KV blocks in use over pool size (U_KV)", labels=["tier"]
        )
        blocks = GaugeMetricFamily(
            "kvpilot_kv_blocks", "KV blocks by tier and state", labels=["tier", "state"]
        )
        for tier, t in s.tiers.items():
            usage.add_metric([tier], t.used_blocks / t.num_blocks if t.num_blocks else 0.0)
            blocks.add_metric([tier, "total"], t.num_blocks)
            blocks.add_metric([tier, "used"], t.used_blocks)
            blocks.add_metric([tier, "cached"], t.cached_blocks)
        yield usage
        yield blocks
        yield _gauge(
            "kvpilot_tau_high_ratio",
            "Admission ceiling on device KV usage (tau_high): new work waits above it",
            s.tau_high,
        )
        yield _gauge("kvpilot_requests_running", "Requests running", s.running)
        yield _gauge("kvpilot_requests_waiting", "Requests waiting for admission", s.waiting)
        yield _gauge("kvpilot_sessions_open", "Open agent sessions", s.open_sessions)
        sessions = GaugeMetricFamily(
            "kvpilot_sessions",
            "Open agent sessions by state: running, waiting (for admission or KV), paused "
            "(off at a tool), idle",
            labels=["state"],
        )
        for state in SESSION_STATES:
            sessions.add_metric([state], s.sessions_by_state.get(state, 0))
        yield sessions
        yield _counter("kvpilot_engine_steps", "Engine steps run", s.steps)
        yield _counter(
            "kvpilot_prompt_tokens", "Prompt tokens of finished requests", s.prompt_tokens
        )
        yield _counter(
            "kvpilot_cached_prompt_tokens",
            "Prompt tokens of finished requests served from the prefix cache",
            s.cached_prompt_tokens,
        )
        yield _counter("kvpilot_generation_tokens", "Tokens generated", s.generated_tokens)
        yield _counter(
            "kvpilot_prefill_tokens", "Tokens whose KV prefill computed", s.prefill_tokens
        )
        yield _counter("kvpilot_requests_finished", "Requests finished", s.requests_finished)
        yield _counter("kvpilot_preemptions", "Sequences preempted", s.preemptions)
        yield _counter(
            "kvpilot_preemptions_swapped",
            "Preemptions that swapped the sequence's KV to host (the rest recompute)",
            s.preemptions_swapped,
        )
        yield _counter(
            "kvpilot_admissions_deferred",
            "Requests held back so that a paused session's state, back soon, stays resident",
            s.admissions_deferred,
        )
        yield _counter("kvpilot_forks", "Trajectory forks", s.forks)
        yield _counter(
            "kvpilot_prefix_cache_queries_tokens",
            "Tokens looked up in the prefix cache",
            s.prefix_queried_tokens,
        )
        yield _counter(
            "kvpilot_prefix_cache_hits_tokens",
            "Tokens found in the prefix cache",
            s.prefix_hit_tokens,
        )
        yield _counter(
            "kvpilot_kv_evicted_blocks", "Blocks evicted from the radix cache", s.evicted_blocks
        )
        yield from _tier_metrics(s)
        yield from _window_metrics(s)


def _window_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    """A hybrid model's sliding-window pool (zeros without one, so that dashboards always
    find the series)."""
    w = s.window or WindowPoolUsage()
    yield _gauge(
        "kvpilot_window_kv_usage_ratio",
        "Sliding-window layers' KV pool: blocks in use over pool size",
        w.usage,
    )
    blocks = GaugeMetricFamily(
        "kvpilot_window_kv_blocks",
        "Sliding-window layers' KV pool by state: total, used (held or cached), held (by "
        "trajectories; admission weighs it against tau_high), cached, free",
        labels=["state"],
    )
    for state, n in (
        ("total", w.num_blocks),
        ("used", w.used_blocks),
        ("held", w.held_blocks),
        ("cached", w.cached_blocks),
        ("free", w.free_blocks),
    ):
        blocks.add_metric([state], n)
    yield blocks
    yield _gauge(
        "kvpilot_window_tokens", "Sliding window of the windowed layers, in tokens", w.window_tokens
    )
    yield _gauge(
        "kvpilot_window_kv_released_blocks",
        "Window-pool blocks open trajectories released outside their window (full attention "
        "would hold them)",
        w.released_blocks,
    )
    yield _gauge(
        "kvpilot_window_kv_saved_bytes",
        "Device bytes the released window blocks would take under full attention",
        w.saved_bytes,
    )


def _tier_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    moved = CounterMetricFamily(
        "kvpilot_kv_bytes_moved", "KV bytes moved between tiers", labels=["direction"]
    )
    for direction in DIRECTIONS:
        moved.add_metric([direction], s.bytes_moved.get(direction, 0))
    yield moved
    decisions = CounterMetricFamily(
        "kvpilot_pause_decisions", "Pause decisions by action", labels=["action"]
    )
    for action in sorted({*PAUSE_ACTIONS, *s.pause_decisions}):
        decisions.add_metric([action], s.pause_decisions.get(action, 0))
    yield decisions
    loaded = CounterMetricFamily(
        "kvpilot_tier_loaded_tokens",
        "Tokens of paused sessions brought back to the device, by the tier they came from",
        labels=["tier"],
    )
    for tier in ("host", "disk"):
        loaded.add_metric([tier], s.loaded_tokens.get(tier, 0))
    yield loaded
    yield _counter(
        "kvpilot_prefetch_hits", "Resumes whose KV a prefetch had brought back", s.prefetch_hits
    )
    yield _counter(
        "kvpilot_prefetch_stalls",
        "Requests that waited for their KV to come back from host or disk",
        s.prefetch_stalls,
    )
    yield _counter(
        "kvpilot_recomputed_tokens",
        "Tokens whose KV was computed before and had to be recomputed",
        s.recomputed_tokens,
    )
    yield _counter(
        "kvpilot_idle_kv_gb_seconds",
        "Device memory-time (GB x s) held by idle sessions' KV",
        s.idle_gb_s,
    )
    yield _counter(
        "kvpilot_disk_misses", "Blocks expected on disk that were missing or corrupt", s.disk_misses
    )
    bandwidth = GaugeMetricFamily(
        "kvpilot_link_bandwidth_bytes_per_second",
        "Measured bandwidth the pause policy uses (0: tier absent)",
        labels=["link"],
    )
    bandwidth.add_metric(["device_host"], s.link_bw_bytes_s)
    bandwidth.add_metric(["disk"], s.disk_bw_bytes_s)
    yield bandwidth


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """The app's registry: engine snapshot collector, latency histograms, server counters."""

    def __init__(self, block_size: int = 16) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # What an unbounded prefix cache would have served: the figure hit rates compare to.
        self.ideal = IdealHitMeter(block_size)
        self.ideal_cached_tokens = Counter(
            "kvpilot_ideal_cached_prompt_tokens",
            "Prompt tokens of finished requests an unbounded prefix cache would have served "
            "(compare with kvpilot_cached_prompt_tokens)",
            registry=self.registry,
        )
        self._lock = threading.Lock()
        self._latest = EngineSnapshot()
        self.ttft = Histogram(
            "kvpilot_time_to_first_token_seconds",
            "Time from arrival to first token",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvpilot_inter_token_latency_seconds",
            "Time between consecutive tokens of a sequence",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "kvpilot_e2e_request_latency_seconds",
            "Time from arrival to the last token",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.tenant_prompt_tokens = Counter(
            "kvpilot_tenant_prompt_tokens",
            "Prompt tokens per tenant",
            ["tenant"],
            registry=self.registry,
        )
        self.tenant_cached_tokens = Counter(
            "kvpilot_tenant_cached_tokens",
            "Prompt tokens served from the prefix cache, per tenant",
            ["tenant"],
            registry=self.registry,
        )
        self.requests_aborted = Counter(
            "kvpilot_requests_aborted",
            "Requests aborted because their client went away",
            registry=self.registry,
        )
        self.http_errors = Counter(
            "kvpilot_http_errors",
            "Requests answered with an error, by status",
            ["status"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(self))

    @property
    def latest(self) -> EngineSnapshot:
        with self._lock:
            return self._latest

    def observe(self, engine: Engine) -> None:
        """Engine thread: drain new latency samples into histograms, publish a snapshot.

        The engine's sample lists are emptied once observed, so a long-running server's
        memory does not grow with every token it has ever served.
        """
        ttft, itl, e2e = engine.stats.drain_samples()
        for samples, histogram in ((ttft, self.ttft), (itl, self.itl), (e2e, self.e2e)):
            for value in samples:
                histogram.observe(value)
        snap = engine.snapshot()
        with self._lock:
            self._latest = snap

    def record_ideal(self, submitted: Submitted, output: RequestOutput) -> None:
        """A request finished: count what an unbounded cache would have served of its prompt
        (never less than what was served), and remember its prompt and output blocks."""
        if submitted.whole_prompt is None:
            return
        self.ideal_cached_tokens.inc(max(submitted.ideal_cached_tokens, output.cached_tokens))
        for branch in output.outputs:  # the KV of every generated token but the last
            self.ideal.add(submitted.whole_prompt + list(branch.token_ids[:-1]), submitted.salt)
        if not output.outputs:
            self.ideal.add(submitted.whole_prompt, submitted.salt)

    def record_request(self, tenant: str | None, prompt_tokens: int, cached_tokens: int) -> None:
        label = tenant or "anonymous"
        self.tenant_prompt_tokens.labels(label).inc(prompt_tokens)
        self.tenant_cached_tokens.labels(label).inc(cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
