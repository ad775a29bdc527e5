"""Pause policies side by side where the trade-off is real: emulated accelerator ratios, the
traces' own waits with a tail of human approvals, an oracle bound, and a simulated node.

The workload (`pause_workload.py`): miniswe trace sessions, each call one session turn whose
context grows exactly as in the trace; the pause after a call is the trace's gap after it,
named by the tool the call ran, as recorded (real seconds), plus on --approval-probability of
pauses a person's approval of a minute to an hour, scaled by the one --time-factor (0.01:
an hour is 36 s).

CPU run (`pause_cpu.py`): the real engine on the `tiny` model (its output depends on the whole
context), device<->host link and disk slowed so that reload : recompute matches --emulate
(from the hardware presets and llama-3-70b's geometry; the achieved ratio is printed). It runs
on the compute clock (`kvpilot.emulate.clock`, --clock compute): the engine's time is the CPU
time of the thread that steps it, and waits (pauses, emulated copies) move the clock on at
once instead of being slept, so a replay costs its compute and a loaded machine changes
little; --clock wall sleeps them. 24 sessions (--quick; 60 without): the trace's, then copies
of them in another agent's words (own token hash, own approvals), in tokens of 8 bytes,
arriving one mean first-turn prefill apart. Each repetition is one draw of the approvals
(--seed + repetition), the same for every policy. --dilation stretches every wait (auto: by
how much slower this CPU prefills than the target, so a wait is as many recomputes long as
there; 1 by default). The device pool holds --device-fraction of the working set and the host
tier --host-fraction, so some pauses must go to disk or be dropped. Every resumed turn's
output is compared with a recompute of the same turn on an engine without tiers (freed blocks
are poisoned): mismatches must be 0.

Simulated node (`pause_sim.py`): llama-3-70b on 8xH100 (the seed's deployment), the same
sessions and waits, pools as fractions of the working set, all policies. Policies in
`TRUE_WAIT_POLICIES` (oracle, infercept-oracle) are told each pause's true wait; every other one is
told the tool only and predicts the wait.

Per policy: completed turns per second, recomputed prefill tokens, p50/p99 time to first
token on resume, GB·s held on device by idle trajectories, bytes moved per tier. The last
line is one JSON object: "policies" (the CPU run), "sim" {"policies"}, and the goals.

--log-pauses FILE writes every pause (run, policy, what it was told, what it chose, the wait it
really had) as JSON lines, to compare policies pause by pause on the same waits.

Usage: python benchmarks/bench_pause.py [--quick] [--emulate h100-pcie5] [--no-sim]
The CPU run's figures are on its clock (compute by default); CPU seconds are beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from pause_cpu import (
    FULL_SHAPE,
    QUICK_SHAPE,
    Pools,
    calibrate,
    cpu_sessions,
    recompute,
    replay,
    target_dilation,
)
from pause_goals import goals, print_verdict
from pause_log import PauseLog
from pause_workload import describe_waits, dilated, pct, working_set_tokens

from kvpilot.emulate.target import EMULATION_TARGETS, emulation_target
from kvpilot.policy.pause import POLICY_NAMES
from kvpilot.trace.waits import WaitModel

ROW_KEYS = (
    "turns_per_s",
    "turns_per_s_range",
    "recomputed_tokens",
    "p50_resume_ttft_s",
    "p99_resume_ttft_s",
    "idle_gb_s",
    "bytes_moved",
    "mismatches",
    "cpu_s",
)
MEDIAN_KEYS = (
    "turns_per_s",
    "recomputed_tokens",
    "p50_resume_ttft_s",
    "p99_resume_ttft_s",
    "idle_gb_s",
    "cpu_s",
    "achieved_link_ratio",
    "achieved_disk_ratio",
)
BLOCK = 16


def print_header() -> None:
    print(
        f"{'policy':<13}{'turns/s':>8}{'recomputed':>11}{'p50 resume':>11}{'p99 resume':>11}"
        f"{'idle GB·s':>10}{'to host MB':>11}{'to disk MB':>11}{'CPU s':>7}{'mismatch':>9}"
        "  decisions"
    )


def print_row(policy: str, r: dict[str, Any]) -> None:
    moved = r["bytes_moved"]
    decisions = ", ".join(f"{k} {v}" for k, v in sorted(r.get("decisions", {}).items()))
    if r.get("demoted_to"):  # where memory pressure sent idle state: host, disk or cache
        decisions += (
            " (demoted to "
            + ", ".join(f"{k} {v}" for k, v in sorted(r["demoted_to"].items()))
            + ")"
        )
    print(
        f"{policy:<13}{r['turns_per_s']:>8.3f}{r['recomputed_tokens']:>11,}"
        f"{r['p50_resume_ttft_s'] * 1e3:>9.1f}ms{r['p99_resume_ttft_s'] * 1e3:>9.1f}ms"
        f"{r['idle_gb_s']:>10.3f}{moved.get('device_to_host', 0) / 1e6:>11.1f}"
        f"{moved.get('device_to_disk', 0) / 1e6:>11.1f}{r.get('cpu_s', r.get('wall_s', 0)):>7.1f}"
        f"{r.get('mismatches', 0):>9}  {decisions}"
    )


def cpu_run(
    args: argparse.Namespace, policies: list[str], log: PauseLog | None = None
) -> dict[str, Any]:
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    draws = [cpu_sessions(args, shape, args.seed + rep) for rep in range(args.reps)]
    sessions = draws[0]  # every draw has the same tokens: only the approvals differ
    work = working_set_tokens(sessions)
    pools = Pools(
        device_blocks=max(int(work * args.device_fraction) // BLOCK, shape.max_tokens // BLOCK + 2),
        host_blocks=int(work * args.host_fraction) // BLOCK,
        disk_blocks=4 * work // BLOCK,
    )
    target = emulation_target(args.emulate)
    expected, rate, per_token, cpu = recompute(
        "tiny", sessions, shape.max_tokens // BLOCK + 2, args.clock
    )
    cal = calibrate(rate, per_token, target, cpu)
    auto = target_dilation(target, rate)
    dilation = auto if args.dilation == "auto" else float(args.dilation)
    draws = [dilated(d, dilation) for d in draws]
    print(
        f"\n== CPU run, tiny: {len(sessions)} sessions ({shape.describe()}), "
        f"{sum(map(len, sessions))} turns, working set {work:,} tokens; device "
        f"{pools.device_blocks * BLOCK:,} tokens, host {pools.host_blocks * BLOCK:,}, disk "
        f"{pools.disk_blocks * BLOCK:,}; {args.clock} clock =="
    )
    waits = WaitModel(args.time_factor, args.approval_probability, seed=args.seed)
    print(
        f"waits: {waits.describe()}, then every wait x {dilation:.2f} (this CPU prefills "
        f"{auto:.2f}x slower than the target); draw 1: {describe_waits(draws[0])}"
    )
    print(
        f"emulating {target.describe()}: local prefill {rate:,.0f} tokens/s (recompute pass, "
        f"{cpu:.1f} CPU s), {per_token:,.0f} KV bytes/token -> link "
        f"{cal.link_bytes_per_s / 1e6:,.1f} MB/s, disk {cal.disk_bytes_per_s / 1e6:,.2f} MB/s"
    )
    print_header()
    reps: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for rep in range(args.reps):
        # Each repetition is one draw of the approvals (seed + rep), the same for every policy;
        # the policies run in a rotated order, so none always runs in the same stretch of a
        # shared machine's load.
        order = policies[rep % len(policies) :] + policies[: rep % len(policies)]
        for policy in order:
            r = replay(
                "tiny", policy, draws[rep], pools, cal, args.ttl, expected, log, rep, args.clock
            )
            reps[policy].append(r)
            print_row(f"{policy} #{rep + 1}", r)
    rows = {p: median_row(rs) for p, rs in reps.items()}
    print(f"\n== CPU run, median of {args.reps} repetitions (spread: min-max turns/s) ==")
    print_header()
    for policy, r in rows.items():
        print_row(policy, r)
    for policy, r in rows.items():
        lo, hi = r["turns_per_s_range"]
        ratios = [
            a["turns_per_s"] / max(b["turns_per_s"], 1e-9)
            for a, b in zip(reps.get("breakeven", reps[policy]), reps[policy], strict=True)
        ]
        print(
            f"  {policy:<13} turns/s {r['turns_per_s']:.3f} ({lo:.3f}-{hi:.3f}); breakeven / "
            f"{policy} in the same repetition: {', '.join(f'{x:.2f}' for x in ratios)}; "
            f"achieved ratio {r['achieved_link_ratio']:.0f}x"
        )
    be = rows.get("breakeven", next(iter(rows.values())))
    print(
        f"achieved ratio (median over breakeven's runs): reload {be['achieved_link_ratio']:.0f}x "
        f"faster than recompute (target {target.link_ratio:.0f}x), disk "
        f"{be['achieved_disk_ratio']:.2f}x (target {target.disk_ratio:.2f}x)"
    )
    return {
        "rows": rows,
        "repetitions": args.reps,
        "target": target.name,
        "target_link_ratio": round(target.link_ratio, 1),
        "target_disk_ratio": round(target.disk_ratio, 2),
        "achieved_link_ratio": be["achieved_link_ratio"],
        "achieved_disk_ratio": be["achieved_disk_ratio"],
        "prefill_tokens_per_s": round(rate, 1),
        "time_factor": args.time_factor,
        "dilation": round(dilation, 3),
        "clock": args.clock,
        "sessions": len(sessions),
        "turns": sum(map(len, sessions)),
    }


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over repetitions, the turns/s spread, mismatches summed; the
    resume TTFT percentiles are those of every repetition's resumes together (one
    repetition's p99 is its second-slowest resume: the median of three such is noise)."""
    row = dict(runs[len(runs) // 2])  # decisions and the like: one run's
    for key in MEDIAN_KEYS:
        row[key] = statistics.median(r[key] for r in runs)
    pooled = [t for r in runs for t in r["resume_ttft_s"]]
    row["p50_resume_ttft_s"] = round(pct(pooled, 0.5), 4)
    row["p99_resume_ttft_s"] = round(pct(pooled, 0.99), 4)
    row["bytes_moved"] = {
        d: statistics.median(r["bytes_moved"].get(d, 0) for r in runs)
        for d in runs[0]["bytes_moved"]
    }
    row["mismatches"] = sum(r["mismatches"] for r in runs)
    tps = [r["turns_per_s"] for r in runs]
    row["turns_per_s_range"] = (min(tps), max(tps))
    row["turns_per_s_runs"] = tps
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--emulate", default="h100-pcie5", choices=sorted(EMULATION_TARGETS))
    parser.add_argument(
        "--time-factor", type=float, default=0.01, help="scale of the approvals' minutes-hours"
    )
    parser.add_argument("--approval-probability", type=float, default=0.1)
    parser.add_argument("--device-fraction", type=float, default=0.35)
    parser.add_argument("--host-fraction", type=float, default=0.4)
    parser.add_argument(
        "--ttl", type=float, default=10.0, help="ttl's (and continuum's default) lease, s"
    )
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sim-seeds", default="0,1,2", help="workload draws of the simulated node (medians)"
    )
    parser.add_argument(
        "--reps", type=int, default=3, help="repetitions of the CPU run, in rotated orders"
    )
    parser.add_argument("--no-sim", action="store_true")
    parser.add_argument("--no-cpu", action="store_true")
    parser.add_argument("--no-disk", action="store_true")
    parser.add_argument("--disk-dir", default=None, help="folder for the disk figures")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--dilation",
        default="1",
        help="the CPU run's waits x this (auto: the target's prefill rate / this CPU's, so "
        "that a wait is as many recomputes long as on the target)",
    )
    parser.add_argument(
        "--clock",
        default="compute",
        choices=("compute", "wall"),
        help="the CPU run's time: the stepping thread's CPU time with waits skipped "
        "(load-robust, costs only the compute), or the wall clock",
    )
    parser.add_argument(
        "--log-pauses",
        default=None,
        help="write every pause's inputs, decision and real wait here (JSON lines)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    policies = args.policies.split(",")
    headline: dict[str, Any] = {}
    log = PauseLog() if args.log_pauses else None
    if not args.no_cpu:
        cpu = cpu_run(args, policies, log)
        headline["policies"] = {p: {k: r[k] for k in ROW_KEYS} for p, r in cpu["rows"].items()}
        headline["emulation"] = {k: v for k, v in cpu.items() if k != "rows"}
        headline["mismatches"] = sum(r["mismatches"] for r in cpu["rows"].values())
        headline["goals"] = {"cpu": goals(headline["policies"])}
        print_verdict("CPU run", headline["goals"]["cpu"])
        print(
            f"turns whose output differs from a recompute of the same turn: "
            f"{headline['mismatches']} (must be 0)"
        )
    if not args.no_disk:
        import tempfile

        from pause_disk import disk_figures

        with tempfile.TemporaryDirectory(prefix="kvpilot-disk-", dir=args.disk_dir) as folder:
            total = (64 if args.quick else 256) << 20
            disk = disk_figures(Path(folder), total, 256 << 10)
        headline["disk"] = disk
        headline["disk_write_fraction_raw"] = disk["disk_write_fraction_raw"]
        headline["disk_read_fraction_raw"] = disk["disk_read_fraction_raw"]
        print(
            f"\ndisk ({disk['total_bytes'] >> 20} MiB in 256 KiB blocks, in "
            f"{args.disk_dir or 'the temp folder'}): "
            f"raw write {disk['raw_write_mb_s']:,.0f} MB/s, read {disk['raw_read_mb_s']:,.0f} MB/s "
            f"(direct I/O: {disk['raw_direct_io']}); store write {disk['store_write_mb_s']:,.0f} "
            f"MB/s ({disk['disk_write_fraction_raw']:.2f} of raw), read "
            f"{disk['store_read_mb_s']:,.0f} MB/s ({disk['disk_read_fraction_raw']:.2f} of raw)"
        )
    if not args.no_sim:
        from pause_sim import sim_run

        sim = sim_run(args, policies, print_header, print_row, log)
        headline["sim"] = sim
        headline.setdefault("goals", {})["sim"] = goals(sim["policies"])
        print_verdict("simulated node", headline["goals"]["sim"])
    if log is not None:
        log.write(Path(args.log_pauses))
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
