"""Admission against a small sliding-window pool: requests wait, or are preempted.

The hybrid test checkpoints (tests/window_models.py: W = 32, block size 8; Mistral-style and
Qwen3-style) serve 8 prompts of four to six windows with a window pool of 16 blocks beside
an idle main pool of 256, once with the window bound of `kvpilot.engine.admission
.WindowAdmission` and once without it (admission counting the main pool only). Printed per
run: steps, preemptions, recomputed and prefilled tokens (counts: they do not depend on
machine load) and CPU seconds (``time.process_time``). Outputs are asserted identical.

Usage: python benchmarks/bench_window_admission.py. The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from window_models import GREEDY, build_hybrid, long_prompts, window_engine


def main() -> int:
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("mistral", "qwen3"):
            path = build_hybrid(arch, Path(tmp))
            outputs = []
            for bounded in (False, True):
                engine = window_engine(
                    path, window_kv_blocks=16, max_prefill_chunk=16, max_num_batched_tokens=64
                )
                if not bounded:
                    engine.scheduler.window_room = None
                start = time.process_time()
                outs = engine.generate(long_prompts(8, seed=12), GREEDY)
                cpu_s = time.process_time() - start
                outputs.append([list(o.outputs[0].token_ids) for o in outs])
                s = engine.snapshot()
                row = {
                    "steps": s.steps,
                    "preemptions": s.preemptions,
                    "recomputed_tokens": s.recomputed_tokens,
                    "prefill_tokens": s.prefill_tokens,
                    "cpu_s": round(cpu_s, 2),
                }
                label = "bounded" if bounded else "main pool only"
                print(f"{arch:8} {label:15} " + " ".join(f"{k} {v}" for k, v in row.items()))
                results[f"{arch} {label}"] = row
            assert outputs[0] == outputs[1], "admission changed the outputs"
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
