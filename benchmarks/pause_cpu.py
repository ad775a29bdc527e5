"""bench_pause.py's CPU run: the real engine on the trace workload, links slowed to a target.

Every policy replays the same sessions on a fresh engine whose device<->host link and disk
are emulated (`kvpilot.emulate`) so that a reload is as many times faster than a recompute
as on the target accelerator node: real copies, real waits, real recompute. On a shared
machine the local prefill rate drifts with the load, so the links track it: their bandwidth is
the target's ratio times the prefill rate measured so far in the same run. The device pool
holds a fraction of the working set and the host tier another, so some pauses must go to
disk or be dropped. Policies in `TRUE_WAIT_POLICIES` are told each pause's true wait; every
other one is told only the tool and predicts the wait from what it has seen.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pause_log import PauseLog
from pause_workload import Turn, agent_rate, common_prefix, load_sessions, pct

from kvpilot.emulate.clock import BenchClock, WallTime, bench_clock
from kvpilot.emulate.disk import ThrottledDiskStore
from kvpilot.emulate.link import LinkSchedule
from kvpilot.emulate.target import EmulationTarget
from kvpilot.emulate.transport import ThrottledTransport
from kvpilot.engine import Engine, EngineConfig, SamplingParams
from kvpilot.policy.pause import TRUE_WAIT_POLICIES
from kvpilot.trace.waits import WaitModel

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
ENGINE_OPTIONS: dict[str, Any] = {"max_num_batched_tokens": 1024, "max_prefill_chunk": 512}
TINY_VOCAB = 256


@dataclass(frozen=True, slots=True)
class Shape:
    """How much of the trace the CPU run replays: sessions (the trace's, then copies with
    their own approvals), the longest context and the most turns per session, in tokens of
    ``chars_per_token`` bytes."""

    sessions: int
    max_tokens: int
    max_turns: int
    chars_per_token: int = 8

    def describe(self) -> str:
        return (
            f"contexts up to {self.max_tokens:,} tokens of {self.chars_per_token} bytes, "
            f"{self.max_turns} turns"
        )


QUICK_SHAPE = Shape(sessions=24, max_tokens=2048, max_turns=10)
FULL_SHAPE = Shape(sessions=60, max_tokens=4096, max_turns=20)


def cpu_sessions(args: Any, shape: Shape, seed: int) -> list[list[Turn]]:
    """The CPU run's sessions with the approvals of draw ``seed`` (waits as recorded)."""
    waits = WaitModel(args.time_factor, args.approval_probability, seed=seed)
    return load_sessions(
        shape.sessions,
        shape.max_tokens,
        waits,
        TINY_VOCAB,
        shape.max_turns,
        chars_per_token=shape.chars_per_token,
        replicas=shape.sessions,  # as many copies as it takes
    )


def target_dilation(target: EmulationTarget, prefill_tokens_per_s: float) -> float:
    """How many times slower this machine prefills than the target node: the factor its
    waits stretch by, so that a wait is as many recomputes long as on the target."""
    return target.context_tokens / target.recompute_s / prefill_tokens_per_s


@dataclass(frozen=True, slots=True)
class Pools:
    device_blocks: int
    host_blocks: int
    disk_blocks: int


class PrefillTally:
    """Prefill tokens over the seconds of the steps that computed them, as the engine's own
    meter sees them (`OffloadManager.observe_step`), summed: the rate the rule prices a
    recompute at, without the decode steps and idle time an end-to-end rate would count."""

    def __init__(self, engine: Engine) -> None:
        self.tokens = 0
        self.seconds = 0.0
        offload = engine.offload
        inner = offload.observe_step

        def observe(prefill_tokens: int, seconds: float, context_tokens: int) -> None:
            if prefill_tokens > 0 and seconds > 0:
                self.tokens += prefill_tokens
                self.seconds += seconds
            inner(prefill_tokens, seconds, context_tokens)

        offload.observe_step = observe

    def rate(self, default: float) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else default


@dataclass(frozen=True, slots=True)
class Calibration:
    """This machine's prefill rate and KV bytes per token, and the links they imply."""

    prefill_tokens_per_s: float
    bytes_per_token: float
    link_bytes_per_s: float
    disk_bytes_per_s: float
    cpu_s: float


def recompute(
    model: str, sessions: list[list[Turn]], kv_blocks: int, clock_name: str = "compute"
) -> tuple[dict[tuple[int, int], list[int]], float, float, float]:
    """Each turn's output from its tokens alone (an engine without tiers or pauses), the
    prefill rate its prefill steps ran at (tokens/s on ``clock_name``'s clock,
    `PrefillTally`), KV bytes per token, and the CPU seconds it took."""
    clock = bench_clock(clock_name)
    engine = Engine.from_pretrained(model, kv_blocks=kv_blocks, clock=clock, **ENGINE_OPTIONS)
    tally = PrefillTally(engine)
    outputs = {}
    cpu = time.process_time()
    for i, turns in enumerate(sessions):
        for t, turn in enumerate(turns):
            (out,) = engine.generate([turn.tokens], PARAMS, salt=f"session-{i}")
            outputs[(i, t)] = list(out.token_ids)
    cpu = time.process_time() - cpu
    rate = tally.rate(1.0)
    runner: Any = engine.executor
    per_token = runner.kv_bytes_per_block / runner.block_size
    engine.close()
    return outputs, rate, per_token, cpu


def calibrate(rate: float, per_token: float, target: EmulationTarget, cpu_s: float) -> Calibration:
    return Calibration(
        prefill_tokens_per_s=rate,
        bytes_per_token=per_token,
        link_bytes_per_s=target.link_bytes_per_s(per_token, rate),
        disk_bytes_per_s=target.disk_bytes_per_s(per_token, rate),
        cpu_s=cpu_s,
    )


def arrival_gap(sessions: list[list[Turn]], cal: Calibration) -> float:
    """Sessions arrive one first turn's prefill apart (the mean one's, at the calibrated
    rate): as fast as the engine can take them in, not all at once (36 cold prefills queued
    together made the first resumes wait seconds behind them: the p99 of the whole run)."""
    first = [len(s[0].tokens) for s in sessions if s]
    return sum(first) / max(len(first), 1) / cal.prefill_tokens_per_s


def emulated_engine(
    model: str,
    policy: str,
    pools: Pools,
    disk_dir: str,
    cal: Calibration,
    ttl_s: float,
    clock: BenchClock,
) -> Engine:
    """An engine with host and disk tiers behind links of the calibrated bandwidths (the
    composition of `kvpilot.model.build.build_engine`, with the tiers wrapped)."""
    from kvpilot.model.runner import ModelRunner
    from kvpilot.model.transfer import TorchTierTransport
    from kvpilot.store import DiskBlockStore, SessionStore

    config = EngineConfig.from_kwargs(
        kv_blocks=pools.device_blocks,
        host_kv_blocks=pools.host_blocks,
        disk_dir=disk_dir,
        disk_kv_blocks=pools.disk_blocks,
        pause_policy=policy,
        pause_ttl_s=ttl_s,
        poison_freed_blocks=True,
        **ENGINE_OPTIONS,
    )
    runner = ModelRunner(model, num_blocks=pools.device_blocks)
    inner = TorchTierTransport(runner.kv_cache, pools.host_blocks)
    real = isinstance(clock, WallTime)  # on the compute clock the copier thread is free
    link = LinkSchedule(cal.link_bytes_per_s, clock, clock.sleep, real_time_counts=real)
    transport = ThrottledTransport(inner, link)
    store = DiskBlockStore(Path(disk_dir), pools.disk_blocks, inner.block_bytes)
    disk_link = LinkSchedule(cal.disk_bytes_per_s, clock, clock.sleep, real_time_counts=real)
    disk = ThrottledDiskStore(store, disk_link)
    return Engine(
        runner,
        config,
        tokenizer=runner.tokenizer,
        eos_token_ids=runner.eos_token_ids,
        max_model_len=runner.max_model_len,
        vocab_size=runner.config.vocab_size,
        clock=clock,
        transport=transport,
        disk=disk,  # type: ignore[arg-type]
        session_store=SessionStore(Path(disk_dir)),
    )


def emulated_links(engine: Engine) -> tuple[LinkSchedule, LinkSchedule]:
    mover = engine.offload.mover
    return mover.transport.link, mover.disk.link  # type: ignore[union-attr]


def track(links: tuple[LinkSchedule, LinkSchedule], cal: Calibration, rate: float) -> None:
    """Keep reload : recompute at the target while the shared machine's speed drifts: the
    links run at the target's ratios times this run's prefill rate so far (the calibration
    pass's until the first prefill step)."""
    per_token = cal.bytes_per_token * rate
    links[0].bytes_per_s = (
        cal.link_bytes_per_s / (cal.bytes_per_token * cal.prefill_tokens_per_s) * per_token
    )
    links[1].bytes_per_s = (
        cal.disk_bytes_per_s / (cal.bytes_per_token * cal.prefill_tokens_per_s) * per_token
    )


def replay(
    model: str,
    policy: str,
    sessions: list[list[Turn]],
    pools: Pools,
    cal: Calibration,
    ttl_s: float,
    expected: dict[tuple[int, int], list[int]],
    log: PauseLog | None = None,
    rep: int = 0,
    clock_name: str = "compute",
    stagger_s: float | None = None,
) -> dict[str, Any]:
    """Replay ``sessions`` under ``policy``: session i's first turn at ``i * stagger_s``
    (default `arrival_gap`), each next turn its pause after the last one finished. On the
    compute clock
    (`kvpilot.emulate.clock`) the pauses and the emulated copies are waited for by moving
    the clock on, so a replay costs its compute; on the wall clock they are slept."""
    told_truth = policy in TRUE_WAIT_POLICIES
    with tempfile.TemporaryDirectory(prefix=f"kvpilot-pause-{policy}-") as disk:
        clock = bench_clock(clock_name)
        engine = emulated_engine(model, policy, pools, disk, cal, ttl_s, clock)
        if log is not None:
            log.attach(engine, {"run": "cpu", "rep": rep, "policy": policy})
        tally, links = PrefillTally(engine), emulated_links(engine)
        offload = engine.offload
        handles = [engine.open_session() for _ in sessions]
        nxt = [0] * len(sessions)
        gap = arrival_gap(sessions, cal) if stagger_s is None else stagger_s
        first = [gap * i for i in range(len(sessions))]
        due, active = list(first), [0.0] * len(sessions)
        pending: dict[str, int] = {}
        busy: set[int] = set()
        turns_done = mismatches = 0
        total = sum(len(s) for s in sessions)
        start, wall0, cpu0 = clock.now(), time.perf_counter(), clock.cpu_s()
        while turns_done < total:
            now = clock.now() - start
            for i, turns in enumerate(sessions):
                if nxt[i] >= len(turns) or i in busy or due[i] > now:
                    continue
                session, turn = handles[i], turns[nxt[i]]
                held = session.tokens
                k = common_prefix(held, turn.tokens)
                if k == len(turn.tokens):
                    k -= 1  # nothing new: resend the last token so the turn has work
                if k < len(held):
                    session.rewind(k)
                last = nxt[i] == len(turns) - 1
                hint = turn.wait_s if told_truth and not last else None
                rid = session.submit(
                    turn.tokens[k:],
                    PARAMS,
                    expected_tool_wait_s=hint,
                    tool=None if last else turn.tool,
                )
                pending[rid] = i
                busy.add(i)
            track(links, cal, tally.rate(cal.prefill_tokens_per_s))
            waits = [d for i, d in enumerate(due) if i not in busy and nxt[i] < len(sessions[i])]
            next_turn = start + min(waits, default=now + 1.0)
            if engine.has_unfinished() or offload.busy():
                engine.step(idle_until=next_turn)
            else:
                timer = offload.next_event_at()
                clock.advance_to(min(next_turn, timer if timer is not None else next_turn))
                engine.step()  # polls copies and fires prefetch timers
            for rid, i in list(pending.items()):
                try:
                    out = engine.get_output(rid)
                except Exception:  # not known yet
                    continue
                if out.finished:
                    engine.pop_output(rid)
                    mismatches += list(out.token_ids) != expected[(i, nxt[i])]
                    del pending[rid]
                    busy.discard(i)
                    now = clock.now() - start
                    due[i] = now + sessions[i][nxt[i]].wait_s
                    nxt[i] += 1
                    turns_done += 1
                    if nxt[i] == len(sessions[i]):
                        active[i] = now - first[i]
        elapsed, cpu = clock.now() - start, clock.cpu_s() - cpu0
        wall = time.perf_counter() - wall0
        stats = offload.stats
        mover = offload.mover
        prefill = tally.rate(cal.prefill_tokens_per_s)
        link = mover.link_bw()
        result = {
            "turns_per_s": round(agent_rate(sessions, active), 3),
            "makespan_turns_per_s": round(turns_done / elapsed, 3),
            "recomputed_tokens": stats.recomputed_tokens,
            "p50_resume_ttft_s": round(pct(stats.resume_ttft_s, 0.5), 4),
            "p99_resume_ttft_s": round(pct(stats.resume_ttft_s, 0.99), 4),
            "resumes": len(stats.resume_ttft_s),
            "resume_ttft_s": list(stats.resume_ttft_s),  # pooled over repetitions
            "idle_gb_s": round(stats.idle_gb_s, 4),
            "bytes_moved": dict(stats.bytes_moved),
            "decisions": dict(stats.decisions),
            "demoted_to": dict(stats.demoted_to),
            "prefill_tokens": engine.stats.prefill_tokens,
            "prefetch_stalls": stats.prefetch_stalls,
            "preemptions": engine.scheduler.num_preemptions,
            "hit_rate": round(engine.stats.hit_rate, 4),
            "elapsed_s": round(elapsed, 2),
            "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2),
            "mismatches": mismatches,
            "achieved_link_ratio": round(link / (cal.bytes_per_token * prefill), 1),
            "achieved_disk_ratio": round(mover.disk_bw() / (cal.bytes_per_token * prefill), 2),
        }
        for s in handles:
            s.close()
        engine.close()
        return result
