"""Engine benchmark: kvpilot against Hugging Face transformers, side by side in one run.

1. Throughput: prefill and decode tokens/s at batch 1, 8 and 32 with mixed prompt lengths,
   for `tiny` and a locally generated ~100M-parameter Llama, against transformers'
   `generate` on the same checkpoint and prompts (greedy, no early stop). Prefill is timed by
   a one-token run; decode from token stamps taken the same way on both sides (each
   request's first to last token: kvpilot's step loop, a transformers streamer; see
   token_timing.py), so it cannot go negative. Every prompt on both sides must produce
   exactly the asked number of tokens (asserted); each timing is the best of `REPEATS` runs
   (engine_sides.py).
2. Prefill-decode interference: 16 streams decoding while a long prompt arrives; p50/p99
   inter-token latency of the streams and the long prompt's time to first token, chunked
   vs monolithic prefill (the spec's Figure 9 claim, as a ratio).
3. Multi-turn replay of the miniswe agent traces: prefix hit rate against the trace's ideal
   (infinite-cache) hit rate, and prefill tokens computed with prefix reuse on vs off.
4. Tensor parallelism: prefill and decode tokens/s of the ~100M (125M-shape) Llama at TP=2
   (gloo on CPU, NCCL on CUDA) against TP=1 on the same cores (on CPU each of the two ranks
   gets half the torch threads), and TP=1 on half the threads (one rank's share: on a busy
   machine OpenMP's threads wait on each other, which alone can make TP=1 look slow). On a
   few CPU cores TP is not expected to be faster: every layer adds two all-reduces through
   the loopback; the point is the path, measured.

Usage: python benchmarks/bench_engine.py [--quick]. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from engine_sides import REPEATS, hf_throughput, ours_throughput

from kvpilot.engine import Engine, SamplingParams
from kvpilot.model import resolve_model_path
from kvpilot.model.checkpoints import make_checkpoint
from kvpilot.trace import ideal_hit_rate, load_trace_calls

CACHE = Path.home() / ".cache" / "kvpilot" / "bench"
TRACES = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "lmcache-agent-trace" / "miniswe"
)


def llama_100m() -> Path:
    path = CACHE / "llama-100m"
    if not (path / "config.json").exists():
        make_checkpoint(
            "llama",
            path,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            vocab_size=32000,
            max_position_embeddings=4096,
        )
    return path


def mixed_prompts(batch: int, seed: int, lo: int = 32, hi: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(lo, hi))] for _ in range(batch)]


def split_rates(
    path: Path, prompts: list[list[int]], new_tokens: int, **options: object
) -> tuple[float, float]:
    """(prefill, decode) tokens/s from one timeline per run: the step that gives every prompt
    its first token ends the prefill, the rest is decode (no difference of two runs, which
    noise on a shared machine can turn negative). Best of `REPEATS` runs each."""
    engine = Engine.from_pretrained(
        str(path), max_num_batched_tokens=8192, max_prefill_chunk=8192, **options
    )
    n_prompt = sum(len(p) for p in prompts)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)

    def run() -> tuple[float, float]:
        engine.kv.radix.evict(engine.kv.device.num_blocks)
        ids = [engine.add_request(list(p), params) for p in prompts]
        started: set[str] = set()
        t0 = time.perf_counter()
        prefilled = 0.0
        while engine.has_unfinished():
            for out in engine.step():
                if out.outputs and out.outputs[0].token_ids:
                    started.add(out.request_id)
            if not prefilled and len(started) == len(ids):
                prefilled = time.perf_counter()
        end = time.perf_counter()
        produced = [len(engine.pop_output(rid).outputs[0].token_ids) for rid in ids]
        assert produced == [new_tokens] * len(ids), f"produced {produced}"
        return n_prompt / (prefilled - t0), len(ids) * (new_tokens - 1) / (end - prefilled)

    run()  # warm-up
    rates = [run() for _ in range(REPEATS)]
    engine.close()
    return max(r[0] for r in rates), max(r[1] for r in rates)


def tp_section(quick: bool) -> dict[str, float]:
    """TP=2 against TP=1 on the ~100M Llama, same prompts, same total torch threads."""
    import os

    path = llama_100m()
    new_tokens = 16 if quick else 32
    threads = torch.get_num_threads()
    half = max(1, threads // 2)
    print(f"\n== Tensor parallelism (llama-100m; tokens/s; {os.cpu_count()} CPU cores) ==")
    print(f"TP1: {threads} torch threads; TP1/2: {half}; TP2: {half} per rank")
    print(
        f"{'batch':>6}{'prefill TP1':>13}{'TP1/2':>8}{'TP2':>8}"
        f"{'decode TP1':>12}{'TP1/2':>8}{'TP2':>8}"
    )
    figures: dict[str, float] = {}
    for batch in [1, 8] if quick else [1, 8, 32]:
        prompts = mixed_prompts(batch, seed=batch)
        p1, d1 = split_rates(path, prompts, new_tokens, kv_blocks=1024)
        torch.set_num_threads(half)  # rank 0's share; the worker sets its own
        try:
            ph, dh = split_rates(path, prompts, new_tokens, kv_blocks=1024)
            p2, d2 = split_rates(path, prompts, new_tokens, kv_blocks=1024, tensor_parallel_size=2)
        finally:
            torch.set_num_threads(threads)
        print(f"{batch:>6}{p1:>13.0f}{ph:>8.0f}{p2:>8.0f}{d1:>12.0f}{dh:>8.0f}{d2:>8.0f}")
        figures |= {
            f"tp1_prefill_tok_s_b{batch}": round(p1, 1),
            f"tp1_half_threads_prefill_tok_s_b{batch}": round(ph, 1),
            f"tp2_prefill_tok_s_b{batch}": round(p2, 1),
            f"tp1_decode_tok_s_b{batch}": round(d1, 1),
            f"tp1_half_threads_decode_tok_s_b{batch}": round(dh, 1),
            f"tp2_decode_tok_s_b{batch}": round(d2, 1),
        }
    return figures


def throughput_section(quick: bool) -> dict[str, float]:
    figures: dict[str, float] = {}
    models = {"tiny": resolve_model_path("tiny"), "llama-100m": llama_100m()}
    batches = [1, 8, 32]
    new_tokens = 16 if quick else 32
    print("\n== Throughput (tokens/s; greedy; prompts 32-256 tokens) ==")
    print(
        f"{'model':<12}{'batch':>6}{'prefill ours':>14}{'prefill HF':>12}"
        f"{'decode ours':>13}{'decode HF':>11}{'decode x':>10}"
    )
    for name, path in models.items():
        for batch in batches:
            prompts = mixed_prompts(batch, seed=batch)
            p_ours, d_ours = ours_throughput(path, prompts, new_tokens)
            p_hf, d_hf = hf_throughput(path, prompts, new_tokens)
            print(
                f"{name:<12}{batch:>6}{p_ours:>14.0f}{p_hf:>12.0f}"
                f"{d_ours:>13.0f}{d_hf:>11.0f}{d_ours / d_hf:>9.2f}x"
            )
            if name == "llama-100m":
                figures[f"prefill_tok_s_b{batch}"] = round(p_ours, 1)
                figures[f"hf_prefill_tok_s_b{batch}"] = round(p_hf, 1)
                figures[f"decode_tok_s_b{batch}"] = round(d_ours, 1)
                figures[f"hf_decode_tok_s_b{batch}"] = round(d_hf, 1)
    return figures


def interference(chunked: bool, long_len: int, streams: int) -> tuple[list[float], float]:
    engine = Engine.from_pretrained(
        "tiny",
        kv_blocks=4096,
        chunked_prefill=chunked,
        max_prefill_chunk=512,
        max_num_batched_tokens=512 + streams,
    )
    rng = random.Random(0)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    ids = [
        engine.add_request([rng.randrange(3, 250) for _ in range(64)], params)
        for _ in range(streams)
    ]
    for _ in range(8):
        engine.step()  # streams are decoding
    long_prompt = [rng.randrange(3, 250) for _ in range(long_len)]
    arrival = time.perf_counter()
    long_id = engine.add_request(long_prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    last = {rid: time.perf_counter() for rid in ids}
    gaps: list[float] = []
    ttft = 0.0
    for _ in range(200):
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id == long_id:
                ttft = now - arrival
            elif out.request_id in last:
                gaps.append(now - last[out.request_id])
                last[out.request_id] = now
        if ttft and len(gaps) > streams * 12:
            break
    for rid in ids:
        engine.abort(rid)
    return gaps, ttft


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def interference_section(quick: bool) -> dict[str, float]:
    long_len = 2048 if quick else 4096
    print(
        f"\n== Prefill-decode interference: 16 streams decoding, a {long_len}-token prompt "
        "arrives (tiny) =="
    )
    figures: dict[str, float] = {}
    for chunked in (True, False):
        gaps, ttft = interference(chunked, long_len, 16)
        name = "chunked" if chunked else "monolithic"
        p50, p99 = pct(gaps, 0.5) * 1e3, pct(gaps, 0.99) * 1e3
        print(
            f"{name:<11} ITL p50 {p50:7.1f} ms  p99 {p99:7.1f} ms   long prompt TTFT "
            f"{ttft * 1e3:7.1f} ms"
        )
        figures[f"p50_itl_ms_{name}"] = round(p50, 2)
        figures[f"p99_itl_ms_{name}"] = round(p99, 2)
        figures[f"long_ttft_ms_{name}"] = round(ttft * 1e3, 1)
    ratio = figures["p99_itl_ms_monolithic"] / figures["p99_itl_ms_chunked"]
    print(f"p99 ITL monolithic / chunked: {ratio:.1f}x")
    figures["p99_itl_ratio"] = round(ratio, 2)
    return figures


def replay(engine: Engine, calls: list[list[int]]) -> tuple[int, int, int]:
    """Each call's prompt (its input and the trace's own output) as one request."""
    prompt_tokens = cached = 0
    computed_before = engine.stats.prefill_tokens + engine.stats.decode_tokens
    for tokens in calls:
        out = engine.generate([tokens], SamplingParams(max_tokens=1, ignore_eos=True))[0]
        prompt_tokens += out.prompt_tokens
        cached += out.cached_tokens
    computed = engine.stats.prefill_tokens + engine.stats.decode_tokens - computed_before
    return prompt_tokens, cached, computed


def replay_section(quick: bool) -> dict[str, float]:
    engine_on = Engine.from_pretrained(
        "tiny", kv_blocks=24576, max_num_batched_tokens=4096, max_prefill_chunk=4096
    )
    tokenizer = engine_on.tokenizer
    limit = engine_on.max_model_len - 1
    sessions = load_trace_calls(TRACES)
    if quick:
        sessions = sessions[:4]
    calls = [
        tokenizer.encode(c.input + c.output, add_special_tokens=False)[:limit]
        for s in sessions
        for c in s.calls
    ]
    block = engine_on.kv.block_size
    ideal = ideal_hit_rate(calls, block)
    print(
        f"\n== Multi-turn replay: {len(sessions)} miniswe sessions, {len(calls)} calls, "
        f"prompts truncated to {limit} tokens (tiny) =="
    )
    t0 = time.perf_counter()
    prompt_tokens, cached, computed_on = replay(engine_on, calls)
    on_s = time.perf_counter() - t0
    hit = cached / prompt_tokens
    off_calls = calls if quick else calls[: len(calls) // 4]
    engine_off = Engine.from_pretrained(
        "tiny",
        kv_blocks=24576,
        enable_prefix_caching=False,
        max_num_batched_tokens=4096,
        max_prefill_chunk=4096,
    )
    t0 = time.perf_counter()
    _, _, computed_off_part = replay(engine_off, off_calls)
    off_s = time.perf_counter() - t0
    # Reuse off computes every prompt token; the part we ran confirms it, the rest is counted.
    computed_off = computed_off_part + sum(len(c) for c in calls[len(off_calls) :])
    print(f"hit rate {hit:.2%}  ideal {ideal:.2%}  gap {100 * (ideal - hit):.2f} points")
    print(
        f"prefill tokens computed: reuse on {computed_on:,}  reuse off {computed_off:,} "
        f"({computed_off / max(computed_on, 1):.1f}x); wall {on_s:.1f} s on vs "
        f"{off_s:.1f} s for {len(off_calls)} of {len(calls)} calls off"
    )
    return {
        "hit_rate": round(hit, 4),
        "ideal_hit_rate": round(ideal, 4),
        "prefill_tokens_reuse_on": computed_on,
        "prefill_tokens_reuse_off": computed_off,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run for a smoke test")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["throughput", "interference", "replay", "tp"]
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    figures: dict[str, float] = {"torch_threads": torch.get_num_threads()}
    if "throughput" not in args.skip:
        figures |= throughput_section(args.quick)
    if "interference" not in args.skip:
        figures |= interference_section(args.quick)
    if "replay" not in args.skip:
        figures |= replay_section(args.quick)
    if "tp" not in args.skip:
        figures |= tp_section(args.quick)
    sys.stdout.flush()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
