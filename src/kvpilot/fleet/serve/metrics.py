"""``/metrics`` of the fleet: every replica's own metrics, labelled ``replica``, plus the
router's (requests routed, KV events applied, resyncs, migrations, replicas up)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def merge_replica_metrics(texts: Mapping[str, str]) -> str:
    """One exposition of several replicas' metrics, each sample labelled ``replica``."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            kind = family.type if family.type != "unknown" else "untyped"
            entry = families.setdefault(family.name, (kind, family.documentation, []))
            for sample in family.samples:
                labels = {"replica": replica, **sample.labels}
                entry[2].append(f"{sample.name}{_labels(labels)} {floatToGoString(sample.value)}")
    lines: list[str] = []
    for name, (kind, doc, samples) in families.items():
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(samples)
    return "\n".join(lines) + "\n" if lines else ""


def router_metrics(
    router: str,
    routed: Mapping[str, int],
    up: Mapping[str, bool],
    events_applied: int,
    resyncs: int,
    migrations: int,
    retries: int,
) -> str:
    lines = [
        "# HELP kvpilot_fleet_routed_requests_total Requests the fleet router sent to a replica.",
        "# TYPE kvpilot_fleet_routed_requests_total counter",
    ]
    for replica, n in routed.items():
        lines.append(
            f'kvpilot_fleet_routed_requests_total{{router="{router}",replica="{replica}"}} {n}'
        )
    lines += [
        "# HELP kvpilot_fleet_replica_up Whether the router sees the replica up (1) or down.",
        "# TYPE kvpilot_fleet_replica_up gauge",
    ]
    for replica, live in up.items():
        lines.append(f'kvpilot_fleet_replica_up{{replica="{replica}"}} {int(live)}')
    for name, help_text, value in (
        ("kv_events_applied_total", "KV events applied to the prefix directory.", events_applied),
        ("directory_resyncs_total", "Snapshot resyncs (a gap, or a restarted replica).", resyncs),
        ("session_migrations_total", "Sessions moved off an overloaded replica.", migrations),
        ("request_retries_total", "Requests sent again after their replica failed.", retries),
    ):
        lines += [
            f"# HELP kvpilot_fleet_{name} {help_text}",
            f"# TYPE kvpilot_fleet_{name} counter",
            f"kvpilot_fleet_{name} {value}",
        ]
    return "\n".join(lines) + "\n"
