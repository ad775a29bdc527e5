"""Pause policies side by side on a replay of real agent traces.

The miniswe traces (`../shared/traces/lmcache-agent-trace/miniswe/`) are replayed as agent
sessions: each call is one session turn; the gap to the session's next call is its tool
wait, time-compressed by --compression (default 5x). Each turn sends what the session does
not hold yet (the trace's own input and output, teacher-forced, so contexts grow exactly as
in the trace; when the history differs the session is rewound to the common prefix) and
generates a few tokens, then the session pauses with the wait as its hint
(`expected_tool_wait_s`). The device pool is deliberately too small for all sessions; a
host tier and a disk tier are available to every policy.

Text becomes tokens by a fixed 4-characters-per-token hash (prefix-stable like a real BPE,
about as dense), so a `tiny` context of 8k tokens holds ~32k characters of trace.

Every policy runs on the same replay in one run. Per policy: completed turns per second,
recomputed prefill tokens, p50/p99 time to first token on resume, GB·s held on device by
idle trajectories, bytes moved per tier, and mismatches: turns whose output differs from a
recompute of the same turn from its tokens (on an engine without tiers, which never pauses
or moves KV; freed blocks are poisoned in every run), which must be 0. The last line is one
JSON object.

Usage: python benchmarks/bench_pause.py [--quick] [--models tiny,llama-100m]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpilot.engine import Engine, SamplingParams
from kvpilot.policy.pause import POLICY_NAMES
from kvpilot.trace import load_trace_calls

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces" / "lmcache-agent-trace" / "miniswe"
CHARS_PER_TOKEN = 4


def tokenize(text: str) -> list[int]:
    """A prefix-stable stand-in for BPE: each 4-character chunk hashes to a byte token."""
    raw = text.encode("utf-8", errors="replace")
    step = CHARS_PER_TOKEN
    return [zlib.crc32(raw[i : i + step]) % 256 for i in range(0, len(raw), step)]


@dataclass(frozen=True, slots=True)
class Turn:
    tokens: list[int]  # the whole context of the call: input and the trace's output
    wait_s: float  # compressed tool wait before the session's next call


def load_sessions(n: int, max_tokens: int, compression: float) -> list[list[Turn]]:
    sessions = []
    for trace in load_trace_calls(TRACES):
        gaps = [*trace.gaps_s, 0.0]
        turns = []
        for call, gap in zip(trace.calls, gaps, strict=True):
            tokens = tokenize(call.input + call.output)
            if len(tokens) > max_tokens:
                break
            turns.append(Turn(tokens, gap / compression))
        if len(turns) >= 2:
            sessions.append(turns)
        if len(sessions) == n:
            break
    return sessions


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def recompute(
    model: str, sessions: list[list[Turn]], kv_blocks: int
) -> dict[tuple[int, int], list[int]]:
    """Each turn's output from its tokens alone: a plain request per turn on an engine
    without tiers or sessions (its prefix cache reuses only its own recompute of the
    session's previous turns, under a salt per session)."""
    engine = Engine.from_pretrained(
        model, kv_blocks=kv_blocks, max_num_batched_tokens=1024, max_prefill_chunk=512
    )
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outputs = {}
    for i, turns in enumerate(sessions):
        for t, turn in enumerate(turns):
            (out,) = engine.generate([turn.tokens], params, salt=f"session-{i}")
            outputs[(i, t)] = list(out.token_ids)
    engine.close()
    return outputs


def replay(
    model: str,
    policy: str,
    sessions: list[list[Turn]],
    kv_blocks: int,
    expected: dict[tuple[int, int], list[int]],
) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"kvpilot-pause-{policy}-") as disk:
        engine = Engine.from_pretrained(
            model,
            kv_blocks=kv_blocks,
            host_kv_blocks=kv_blocks * 4,
            disk_dir=disk,
            disk_kv_blocks=kv_blocks * 16,
            pause_policy=policy,
            max_num_batched_tokens=1024,
            max_prefill_chunk=512,
            poison_freed_blocks=True,
        )
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        handles = [engine.open_session() for _ in sessions]
        nxt = [0] * len(sessions)
        due = [0.02 * i for i in range(len(sessions))]
        pending: dict[str, int] = {}
        turns_done = mismatches = 0
        start = time.perf_counter()
        while turns_done < sum(len(s) for s in sessions):
            now = time.perf_counter() - start
            for i, turns in enumerate(sessions):
                if nxt[i] >= len(turns) or i in pending.values() or due[i] > now:
                    continue
                session, turn = handles[i], turns[nxt[i]]
                held = session.tokens
                k = common_prefix(held, turn.tokens)
                if k == len(turn.tokens):
                    k -= 1  # nothing new: resend the last token so the turn has work
                if k < len(held):
                    session.rewind(k)
                rid = session.submit(
                    turn.tokens[k:], params, expected_tool_wait_s=turn.wait_s, tool="bash"
                )
                pending[rid] = i
            if engine.has_unfinished() or engine.offload.busy():
                engine.step()
            else:
                waits = [d for i, d in enumerate(due) if nxt[i] < len(sessions[i])]
                timer = engine.offload.next_event_at()
                nearest = min([*waits, *([timer - start] if timer else [])], default=now)
                time.sleep(min(max(nearest - now, 0.0), 0.005))
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
                    due[i] = time.perf_counter() - start + sessions[i][nxt[i]].wait_s
                    nxt[i] += 1
                    turns_done += 1
        wall = time.perf_counter() - start
        stats = engine.offload.stats
        result = {
            "turns_per_s": round(turns_done / wall, 3),
            "recomputed_tokens": stats.recomputed_tokens,
            "p50_resume_ttft_s": round(pct(stats.resume_ttft_s, 0.5), 4),
            "p99_resume_ttft_s": round(pct(stats.resume_ttft_s, 0.99), 4),
            "idle_gb_s": round(stats.idle_gb_s, 4),
            "bytes_moved": dict(stats.bytes_moved),
            "decisions": dict(stats.decisions),
            "prefill_tokens": engine.stats.prefill_tokens,
            "preemptions": engine.scheduler.num_preemptions,
            "hit_rate": round(engine.stats.hit_rate, 4),
            "wall_s": round(wall, 2),
            "mismatches": mismatches,
        }
        for s in handles:
            s.close()
        engine.close()
        return result


def llama_100m() -> str:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_engine import llama_100m as make

    return str(make())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="tiny,llama-100m")
    parser.add_argument("--compression", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    setups = {
        # model: (sessions, max tokens per call, device blocks)
        "tiny": (8, 4096, 600) if args.quick else (16, 8000, 1200),
        "llama-100m": (3, 4000, 300) if args.quick else (6, 4000, 300),
    }
    report: dict[str, dict] = {}
    for name in args.models.split(","):
        n, max_tokens, blocks = setups[name]
        sessions = load_sessions(n, max_tokens, args.compression)
        if not sessions:
            raise SystemExit(f"no trace session fits {max_tokens} tokens per call for {name}")
        model = "tiny" if name == "tiny" else llama_100m()
        work = sum(len(t.tokens) for s in sessions for t in s)
        print(
            f"\n== {name}: {len(sessions)} sessions, {sum(map(len, sessions))} turns, "
            f"device pool {blocks} blocks ({blocks * 16} tokens) for a working set of up to "
            f"{sum(len(s[-1].tokens) for s in sessions)} tokens; tool waits compressed "
            f"{args.compression:g}x; {work} context tokens in all =="
        )
        print(
            f"{'policy':<14}{'turns/s':>8}{'recomputed':>12}{'p50 resume':>12}{'p99 resume':>12}"
            f"{'idle GB·s':>11}{'to host MB':>11}{'to disk MB':>11}{'preempt':>9}"
            f"{'mismatch':>10}"
        )
        expected = recompute(model, sessions, max(blocks, max_tokens // 16 + 2))
        report[name] = {}
        for policy in POLICY_NAMES:
            r = replay(model, policy, sessions, blocks, expected)
            report[name][policy] = r
            moved = r["bytes_moved"]
            print(
                f"{policy:<14}{r['turns_per_s']:>8.2f}{r['recomputed_tokens']:>12,}"
                f"{r['p50_resume_ttft_s'] * 1e3:>10.0f}ms{r['p99_resume_ttft_s'] * 1e3:>10.0f}ms"
                f"{r['idle_gb_s']:>11.3f}{moved['device_to_host'] / 1e6:>11.1f}"
                f"{moved['device_to_disk'] / 1e6:>11.1f}{r['preemptions']:>9}"
                f"{r['mismatches']:>10}"
            )
        be = report[name]["breakeven"]
        others = [v for k, v in report[name].items() if k != "breakeven"]
        best = max(others, key=lambda v: v["turns_per_s"])
        ratio = report[name]["lru"]["recomputed_tokens"] / max(be["recomputed_tokens"], 1)
        print(
            f"breakeven: {be['turns_per_s'] / best['turns_per_s']:.2f}x the best other policy's "
            f"turns/s; p99 resume {be['p99_resume_ttft_s'] * 1e3:.0f} ms vs "
            f"{best['p99_resume_ttft_s'] * 1e3:.0f} ms; recomputes {ratio:.1f}x fewer tokens "
            "than lru"
        )
    headline = {
        "policies": {
            policy: {
                k: report[name][policy][k]
                for k in (
                    "turns_per_s",
                    "recomputed_tokens",
                    "p50_resume_ttft_s",
                    "p99_resume_ttft_s",
                    "idle_gb_s",
                    "bytes_moved",
                    "mismatches",
                )
            }
            for name in report
            for policy in ([] if name != next(iter(report)) else POLICY_NAMES)
        },
        "by_model": report,
        "mismatches": sum(r["mismatches"] for by in report.values() for r in by.values()),
        "compression": args.compression,
    }
    print(
        f"\nturns whose output differs from a recompute of the same turn: "
        f"{headline['mismatches']} (must be 0)"
    )
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
