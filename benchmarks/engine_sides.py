"""The two sides of bench_engine.py's throughput table, measured the same way: prefill from
a one-token run, decode from token stamps (token_timing.py), best of ``REPEATS`` runs each;
every prompt must produce exactly the asked number of tokens on both sides (asserted)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from token_timing import TokenClock, assert_same_tokens, decode_tokens_per_s

from kvpilot.engine import Engine, SamplingParams

REPEATS = 2  # each timing is the best of this many runs


def ours_throughput(
    path: Path, prompts: list[list[int]], new_tokens: int, **options: object
) -> tuple[float, float]:
    """(prefill, decode) tokens/s: prefill from a one-token run, decode from token stamps."""
    given: dict[str, object] = {"kv_blocks": 4096} | options
    engine = Engine.from_pretrained(
        str(path), max_num_batched_tokens=8192, max_prefill_chunk=8192, **given
    )
    n_prompt = sum(len(p) for p in prompts)

    def run(n: int) -> tuple[float, TokenClock]:
        engine.kv.radix.evict(engine.kv.device.num_blocks)
        clock = TokenClock()
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        ids = [engine.add_request(list(p), params) for p in prompts]
        while engine.has_unfinished():
            for out in engine.step():
                clock.seen(out.request_id, len(out.outputs[0].token_ids))
        elapsed = time.perf_counter() - t0
        for rid in ids:
            engine.pop_output(rid)
        assert_same_tokens({"kvpilot": list(clock.count.values())}, n, len(prompts))
        return elapsed, clock

    run(2)  # warm-up
    prefill_s = min(run(1)[0] for _ in range(REPEATS))
    decode = max(decode_tokens_per_s(run(new_tokens)[1].summary()) for _ in range(REPEATS))
    engine.close()
    return n_prompt / prefill_s, decode


def hf_throughput(path: Path, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """As `ours_throughput`, through `generate` with a streamer that stamps every row's tokens."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    class Stamps(BaseStreamer):  # type: ignore[misc]
        """generate() puts the prompt first, then each step's new token of every row."""

        def __init__(self) -> None:
            self.clock = TokenClock()
            self.puts = 0

        def put(self, value: torch.Tensor) -> None:
            if self.puts:
                now = time.perf_counter()
                for row in range(len(prompts)):
                    self.clock.seen(row, self.puts, now)
            self.puts += 1

        def end(self) -> None:
            pass

    def run(n: int) -> tuple[float, TokenClock]:
        # A config of its own: the checkpoint's EOS ids must not stop any row early.
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            eos_token_id=None,
            pad_token_id=pad,
        )
        stamps = Stamps()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, generation_config=config, streamer=stamps
            )
        elapsed = time.perf_counter() - t0
        produced = out.shape[1] - ids.shape[1]
        assert produced == n, f"transformers produced {produced} tokens per row, wanted {n}"
        assert_same_tokens({"transformers": list(stamps.clock.count.values())}, n, len(prompts))
        return elapsed, stamps.clock

    run(1)  # warm-up
    prefill_s = min(run(1)[0] for _ in range(REPEATS))
    decode = max(decode_tokens_per_s(run(new_tokens)[1].summary()) for _ in range(REPEATS))
    n_prompt = sum(len(p) for p in prompts)
    return n_prompt / prefill_s, decode
