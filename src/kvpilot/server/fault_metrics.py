"""Faults the server survived, as Prometheus counters: disk writes that failed (blocks and
sessions not stored), engine steps that failed, and restarts of the engine loop.

The counters are read from any thread: each store counts under its own lock and the loop's
counters are plain integers, so nothing here waits for the engine thread.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpilot.server.async_engine import AsyncEngine
from kvpilot.store.faults import FaultEpisodes


class FaultCollector(Collector):
    def __init__(self, engine: AsyncEngine, others: dict[str, FaultEpisodes] | None = None) -> None:
        self.engine = engine
        self.others = others or {}  # more stores, by what they hold (the usage ledger, ...)

    def collect(self) -> Iterator[Metric]:
        offload = self.engine.engine.offload
        writes = CounterMetricFamily(
            "kvpilot_disk_write_errors",
            "Disk writes that failed (full disk, I/O error): not stored, recomputed when needed",
            labels=["what"],
        )
        disk, sessions = offload.disk, offload.session_store
        writes.add_metric(["blocks"], _failures(disk))
        writes.add_metric(["sessions"], _failures(sessions))
        for what, faults in self.others.items():
            writes.add_metric([what], faults.failures)
        yield writes
        yield CounterMetricFamily(
            "kvpilot_engine_step_faults",
            "Engine steps that raised: their requests failed, the loop went on",
            value=self.engine.faults,
        )
        yield CounterMetricFamily(
            "kvpilot_engine_loop_restarts",
            "Times the engine loop died and its supervisor restarted it",
            value=self.engine.restarts,
        )


def _failures(store: object) -> int:
    """A store's failed writes (0 without a store, or for one that keeps no count)."""
    faults = getattr(store, "faults", None)
    return faults.failures if isinstance(faults, FaultEpisodes) else 0
