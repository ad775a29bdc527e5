"""One reading of a running server: its Prometheus metrics, health and sessions."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # monotonic seconds
    metrics: dict[str, dict[Labels, float]]  # sample name -> sorted labels -> value
    health: dict[str, Any] = field(default_factory=dict)
    sessions: list[dict[str, Any]] = field(default_factory=list)

    def value(self, name: str, **labels: str) -> float:
        """One sample's value (0 when the server does not export it)."""
        return self.metrics.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def by(self, name: str, label: str) -> dict[str, float]:
        """``{label value: value}`` over the samples of ``name`` that carry only ``label``."""
        out = {}
        for labels, value in self.metrics.get(name, {}).items():
            if len(labels) == 1 and labels[0][0] == label:
                out[labels[0][1]] = value
        return out


def parse_metrics(text: str) -> dict[str, dict[Labels, float]]:
    """Prometheus text exposition -> sample name -> labels -> value (counters end _total)."""
    out: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = float(s.value)
    return out


class ServerUnreachable(Exception):
    """The server did not answer (or refused the API key)."""


def read_sample(client: httpx.Client) -> Sample:
    """Read ``/metrics``, ``/health`` and ``/v1/sessions`` from ``client``'s server."""
    try:
        metrics = client.get("/metrics")
        metrics.raise_for_status()
        health = client.get("/health")
        sessions = client.get("/v1/sessions")
    except httpx.HTTPError as exc:
        raise ServerUnreachable(f"cannot read {client.base_url}: {exc}") from exc
    if sessions.status_code == 401:
        raise ServerUnreachable(f"{client.base_url} refused the API key: give --api-key")
    return Sample(
        at=time.monotonic(),
        metrics=parse_metrics(metrics.text),
        health=health.json() if health.status_code in (200, 503) else {},
        sessions=sessions.json().get("data", []) if sessions.status_code == 200 else [],
    )
