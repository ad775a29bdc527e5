"""Sliding-window block release: KV held per sequence at a long context, with and without.

For a Mistral-style checkpoint (every layer windowed) and a Qwen3-style mixed one (one full
layer, three windowed), both with W = 256 tokens and block size 16, ``--seqs`` sequences
each prefill a ``--context``-token prompt (in 256-token chunks) and decode 32 tokens. At
every step the engine's held blocks are sampled: the full group's device blocks (every
block of every layer when release is off) and the window group's blocks held by running
work (cached, evictable ones excluded). KV bytes held per sequence are
``blocks x bytes per block`` for each group; the peak is reported. Outputs with and without
release are asserted identical. The figures are counts of blocks, not timings: they do not
depend on machine load.

Usage: python benchmarks/bench_window.py [--context 4096] [--seqs 4]. The last line printed
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from kvpilot.engine import Engine, SamplingParams
from kvpilot.model.checkpoints import make_checkpoint
from kvpilot.model.runner import ModelRunner

WINDOW = 256
BLOCK = 16
PARAMS = SamplingParams(max_tokens=32, ignore_eos=True)
MODELS = {
    "mistral (all windowed)": ("mistral", {"num_hidden_layers": 4}),
    "qwen3 (1 full + 3 windowed)": (
        "qwen3",
        {
            "num_hidden_layers": 4,
            "use_sliding_window": True,
            "max_window_layers": 1,
            "layer_types": ["full_attention"] + ["sliding_attention"] * 3,
        },
    ),
}


def peak_held(engine: Engine, prompts: list[list[int]]) -> tuple[int, int, list[list[int]]]:
    """Peak (full-group device blocks, window-group held blocks) and the outputs."""
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    full = window = 0
    while engine.has_unfinished():
        engine.step()
        full = max(full, engine.kv.device.num_used - engine.kv.radix.evictable_blocks())
        if engine.kv.window is not None:
            window = max(window, engine.kv.window.held_blocks())
    return full, window, [list(engine.pop_output(r).token_ids) for r in ids]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--seqs", type=int, default=4)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(args.context)] for _ in range(args.seqs)]
    blocks = args.seqs * (-(-(args.context + PARAMS.max_tokens) // BLOCK)) + 8
    results = {}
    print(f"context {args.context} tokens, {args.seqs} sequences, W={WINDOW}, B={BLOCK}")
    print(f"{'model':30} {'release':>8} {'full blk/seq':>13} {'win blk/seq':>12} {'KV/seq':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, (arch, overrides) in MODELS.items():
            path = make_checkpoint(
                arch,
                Path(tmp) / arch,
                sliding_window=WINDOW,
                max_position_embeddings=args.context * 2,
                **overrides,
            )
            outputs = []
            kv_per_seq = {}
            for release in (False, True):
                engine = Engine.from_pretrained(
                    str(path),
                    kv_blocks=blocks,
                    block_size=BLOCK,
                    max_prefill_chunk=256,
                    max_num_batched_tokens=256 * args.seqs,
                    release_window_blocks=release,
                )
                full, window, out = peak_held(engine, prompts)
                outputs.append(out)
                runner = engine.executor
                assert isinstance(runner, ModelRunner)
                kv = full * runner.kv_cache.bytes_per_block
                if runner.window is not None:
                    kv += window * runner.window.cache.bytes_per_block
                kv_per_seq[release] = kv / args.seqs
                print(
                    f"{label:30} {release!s:>8} {full / args.seqs:13.1f} "
                    f"{window / args.seqs:12.1f} {kv / args.seqs / 2**20:8.2f}MiB"
                )
            assert outputs[0] == outputs[1], "release changed the outputs"
            results[arch] = {
                "kv_bytes_per_seq_kept": kv_per_seq[False],
                "kv_bytes_per_seq_released": kv_per_seq[True],
                "saving_x": round(kv_per_seq[False] / kv_per_seq[True], 2),
            }
    print(json.dumps({"context": args.context, "window": WINDOW, "block": BLOCK, **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
