"""Issue 18's goals for the break-even rule, checked on one run's policy rows."""

from __future__ import annotations

from typing import Any

from kvpilot.policy.pause import TRUE_WAIT_POLICIES

P99_SLACK = 1.05
ORACLE_GAP = 0.05
LRU_RECOMPUTE_FACTOR = 1.5


def goals(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Breakeven's standing: turns/s against each other policy (and the p99 it costs), its
    gap to the oracle, and how many times fewer tokens it recomputes than lru."""
    be = rows.get("breakeven")
    if be is None:
        return {}
    beaten_by = []
    for name, r in rows.items():
        if name == "breakeven" or name in TRUE_WAIT_POLICIES:
            continue  # the bounds: they are told each pause's true wait
        slower = be["turns_per_s"] < r["turns_per_s"]
        worse_tail = be["p99_resume_ttft_s"] > P99_SLACK * r["p99_resume_ttft_s"]
        if slower or worse_tail:
            beaten_by.append(name)
    out: dict[str, Any] = {"beaten_by": beaten_by}
    if "oracle" in rows:
        out["vs_oracle"] = round(be["turns_per_s"] / rows["oracle"]["turns_per_s"], 3)
    if "lru" in rows:
        out["fewer_recomputed_than_lru"] = round(
            rows["lru"]["recomputed_tokens"] / max(be["recomputed_tokens"], 1), 2
        )
    out["met"] = (
        not beaten_by
        and out.get("vs_oracle", 1.0) >= 1 - ORACLE_GAP
        and out.get("fewer_recomputed_than_lru", LRU_RECOMPUTE_FACTOR) >= LRU_RECOMPUTE_FACTOR
    )
    return out


def print_verdict(run: str, g: dict[str, Any]) -> None:
    if not g:
        return
    beaten = ", ".join(g["beaten_by"]) or "none"
    print(
        f"{run}: breakeven beaten (fewer turns/s, or p99 resume > {P99_SLACK}x) by: "
        f"{beaten}; {g.get('vs_oracle', float('nan')):.3f}x the oracle's turns/s; "
        f"{g.get('fewer_recomputed_than_lru', float('nan')):.2f}x fewer recomputed tokens than "
        f"lru; goals met: {g['met']}"
    )
