"""bench_pause.py's simulated node: the same sessions and waits on llama-3-70b over 8xH100.

The simulator runs the real engine (scheduler, radix cache, offload manager, pause policies)
with a roofline cost model on virtual time (`kvpilot.sim`), so the waits are the recorded
ones, in real seconds, with approvals on the bench's one time factor. Contexts are the
trace's own (no cut). The device pool is --device-fraction of the working set and the host
tier --host-fraction, so the working set fits in neither; the disk tier (`kvpilot.sim.disk`,
the node's NVMe) holds the rest. Each workload draw (--sim-seeds: which pauses get a person's
approval, and how long) runs every policy; the figures compared are the medians over draws,
since at margins of hundredths of a percent one draw's ranking turns on single decisions,
except the resume TTFT percentiles, which are taken over every resume of every draw: a draw
has about 380 resumes, so its p99 is its fourth-slowest resume, and the median of three such
figures moves by a fifth when one session's turn is served a step later.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

from pause_log import PauseLog
from pause_workload import (
    Turn,
    agent_rate,
    common_prefix,
    describe_waits,
    load_sessions,
    pct,
    working_set_tokens,
)

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.session import Session
from kvpilot.policy.pause import TRUE_WAIT_POLICIES
from kvpilot.sim.build import SimSetup, build_engine
from kvpilot.sim.simulator import Simulator
from kvpilot.trace.waits import WaitModel

MODEL, NODE, TP = "llama-3-70b", "8xh100", 8
VOCAB = 32000
OUTPUT_TOKENS = 4
BLOCK = 16  # the engine's default block size
MAX_CONTEXT_TOKENS = 131072
DISK_FRACTION = 4  # the disk tier holds 4x the working set (as in the CPU run)
RESUMES = "resume_ttft_s"  # a row's every resume TTFT, pooled over draws, not printed
FIGURES = (
    "turns_per_s",
    "recomputed_tokens",
    "p50_resume_ttft_s",
    "p99_resume_ttft_s",
    "idle_gb_s",
)


class PauseReplayDriver:
    """Each session's turns in order: send what the session does not hold, pause on the
    turn's tool (told the true wait when ``told_truth``), come back after the wait."""

    def __init__(self, sessions: list[list[Turn]], told_truth: bool) -> None:
        self.sessions = sessions
        self.told_truth = told_truth
        self.handles: list[Session | None] = [None] * len(sessions)
        self.turns = 0
        self.rejected = 0
        self.started = [0.0] * len(sessions)
        self.active_s = [0.0] * len(sessions)  # first call to last turn's end, per session
        self._sim: Simulator | None = None

    def counters(self) -> dict[str, int]:
        return {"turns": self.turns, "rejected": self.rejected}

    def start(self, sim: Simulator) -> None:
        self._sim = sim
        for i in range(len(self.sessions)):
            sim.at(0.02 * i, functools.partial(self._send, i, 0))

    def _send(self, i: int, t: int) -> None:
        sim = self._sim
        assert sim is not None
        session = self.handles[i]
        if session is None:
            session = self.handles[i] = sim.engine.open_session()
            self.started[i] = sim.now
        turn, last = self.sessions[i][t], t == len(self.sessions[i]) - 1
        k = common_prefix(session.tokens, turn.tokens)
        if k == len(turn.tokens):
            k -= 1
        if k < len(session.tokens):
            session.rewind(k)
        pause = None
        if not last:
            pause = (turn.wait_s if self.told_truth else None, turn.tool)
        rid = sim.submit(
            turn.tokens[k:],
            OUTPUT_TOKENS,
            lambda _out: self._done(i, t),
            session=session,
            pause=pause,
        )
        if rid is None:
            self.rejected += 1
            self._done(i, t)

    def _done(self, i: int, t: int) -> None:
        sim = self._sim
        assert sim is not None
        self.turns += 1
        turns = self.sessions[i]
        if t + 1 >= len(turns):
            self.active_s[i] = sim.now - self.started[i]
            session = self.handles[i]
            if session is not None:
                session.close()
            return
        sim.after(turns[t].wait_s, functools.partial(self._send, i, t + 1))


def run_policy(
    setup: SimSetup,
    sessions: list[list[Turn]],
    policy: str,
    log: PauseLog | None = None,
    draw: int = 0,
) -> dict[str, Any]:
    engine, _ = build_engine(setup, VOCAB, policy)
    if log is not None:
        log.attach(engine, {"run": "sim", "draw": draw, "policy": policy})
    sim = Simulator(engine, duration_s=setup.duration_s, sample_interval_s=setup.sample_interval_s)
    driver = PauseReplayDriver(sessions, policy in TRUE_WAIT_POLICIES)
    cpu = time.process_time()
    sim.run(driver)
    cpu = time.process_time() - cpu
    stats = engine.offload.stats
    return {
        "turns_per_s": round(agent_rate(sessions, driver.active_s), 4),
        "recomputed_tokens": stats.recomputed_tokens,
        "p50_resume_ttft_s": round(pct(stats.resume_ttft_s, 0.5), 4),
        "p99_resume_ttft_s": round(pct(stats.resume_ttft_s, 0.99), 4),
        "idle_gb_s": round(stats.idle_gb_s, 3),
        "bytes_moved": dict(stats.bytes_moved),
        "decisions": dict(stats.decisions),
        "demoted_to": dict(stats.demoted_to),
        "turns": driver.turns,
        "rejected": driver.rejected,
        "makespan_s": round(sim.now, 2),
        "wall_s": round(sim.wall_s, 2),
        "cpu_s": round(cpu, 2),
        RESUMES: list(stats.resume_ttft_s),
    }


def median_rows(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per policy, the median over workload draws of each figure (bytes per direction too),
    except the resume TTFT percentiles: those of every resume of every draw, pooled."""
    out: dict[str, dict[str, Any]] = {}
    for policy in runs[0]:
        rows = [run[policy] for run in runs]
        row: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in FIGURES}
        pooled = [t for r in rows for t in r[RESUMES]]
        row["p50_resume_ttft_s"] = round(pct(pooled, 0.5), 4)
        row["p99_resume_ttft_s"] = round(pct(pooled, 0.99), 4)
        row["bytes_moved"] = {
            d: statistics.median(r["bytes_moved"].get(d, 0) for r in rows)
            for d in rows[0]["bytes_moved"]
        }
        row["decisions"] = rows[0]["decisions"] if len(rows) == 1 else {}
        out[policy] = row
    return out


def sim_run(
    args: argparse.Namespace,
    policies: list[str],
    print_header: Callable[[], None],
    print_row: Callable[[str, dict[str, Any]], None],
    log: PauseLog | None = None,
) -> dict[str, Any]:
    """Every policy on each workload draw (--sim-seeds: the approvals' draws), then the median
    per policy: one draw's ranking at these margins turns on single decisions."""
    runs, works = [], []
    seeds = [int(x) for x in str(args.sim_seeds).split(",")]
    for seed in seeds:
        waits = WaitModel(args.time_factor, args.approval_probability, seed=seed)
        sessions = load_sessions(20, MAX_CONTEXT_TOKENS, waits, VOCAB)
        work = working_set_tokens(sessions)
        base = SimSetup(model=MODEL, node=NODE, tp=TP)
        per_token = base.geometry().bytes_per_token(TP)
        engine = EngineConfig.from_kwargs(
            max_num_seqs=256, max_num_batched_tokens=2048, pause_ttl_s=args.ttl
        )
        setup = dataclasses.replace(
            base,
            kv_blocks=int(work * args.device_fraction) // BLOCK,
            host_kv_bytes_per_device=work * args.host_fraction * per_token,
            disk_kv_bytes_per_device=work * DISK_FRACTION * per_token,
            engine=engine,
            duration_s=24 * 3600.0,
        )
        print(
            f"\n== simulated node, draw {seed}: {MODEL} on {NODE} (TP {TP}), "
            f"{len(sessions)} sessions, {sum(map(len, sessions))} turns, working set "
            f"{work:,} tokens; device pool {setup.kv_blocks * BLOCK:,} tokens, host "
            f"{int(work * args.host_fraction):,}, disk {work * DISK_FRACTION:,} (NVMe "
            f"{setup.parsed_node().nvme_bw_bytes_s / 1e9:g} GB/s per node) =="
        )
        print(f"waits: {waits.describe()}; {describe_waits(sessions)}")
        print_header()
        rows = {}
        for policy in policies:
            rows[policy] = run_policy(setup, sessions, policy, log, seed)
            print_row(policy, rows[policy])
        runs.append(rows)
        works.append(work)
    medians = median_rows(runs)
    for rows in runs:  # the JSON keeps each draw's figures, not its every resume
        for row in rows.values():
            del row[RESUMES]
    if len(runs) > 1:
        print(
            f"\n== simulated node, median over draws {', '.join(map(str, seeds))} "
            "(resume TTFT: percentiles of every draw's resumes together) =="
        )
        print_header()
        for policy, row in medians.items():
            print_row(policy, row)
    keys = (*FIGURES, "bytes_moved")
    return {
        "policies": {p: {k: r[k] for k in keys} for p, r in medians.items()},
        "model": MODEL,
        "node": NODE,
        "seeds": seeds,
        "working_set_tokens": works,
        "by_seed": {str(s): rows for s, rows in zip(seeds, runs, strict=True)},
    }
