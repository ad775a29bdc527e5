#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go (under 5 minutes on one GPU):
#   1. the CUDA tests of the suite (the Triton kernels on the device against the reference,
#      CUDA graphs against eager decoding, the pinned host pool, CPU/CUDA agreement);
#   2. one tier round trip through pinned memory, timed (GB/s each way);
#   3. a short decode benchmark: the `triton` backend with CUDA graphs against the `torch`
#      reference backend, eager, on a ~100M Llama (bf16), batch 1/8/32.
# Usage: bash scripts/gpu_check.sh   (from the repository root; uses .venv if present)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

"$PY" - <<'EOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch; nothing to check")
print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
EOF

echo "== 1. CUDA tests =="
timeout 120 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_attention_triton.py tests/test_cuda_graphs.py tests/test_transfer.py \
    tests/test_model_runner.py -k "cuda or triton or Triton or graph or transfer or pinned or split" \
    2>&1 | tail -15

echo "== 2. Tier round trip through pinned memory =="
timeout 40 "$PY" - <<'EOF'
import time, torch
from types import SimpleNamespace
from kvpilot.model.kv_cache import KVCache
from kvpilot.model.transfer import TorchTierTransport

geometry = SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128)  # a Llama-8B block
cache = KVCache(geometry, 2048, 16, torch.bfloat16, torch.device("cuda"))
cache.data.normal_()
transport = TorchTierTransport(cache, num_host_blocks=1024)
assert transport.host.is_pinned()
pairs = [(d, h) for h, d in enumerate(range(0, 2048, 2))]  # 1024 blocks, scattered on device
original = cache.data[:, :, 0:2048:2].clone()
out_s = transport.swap_out(pairs).result()
cache.data[:, :, 0:2048:2] = 0
in_s = transport.swap_in([(h, d) for d, h in pairs]).result()
assert torch.equal(cache.data[:, :, 0:2048:2], original), "round trip changed the KV"
nbytes = len(pairs) * transport.block_bytes
print(f"{nbytes / 2**30:.2f} GiB out {nbytes / out_s / 1e9:.1f} GB/s, in {nbytes / in_s / 1e9:.1f} GB/s")
transport.close()
EOF

echo "== 3. Decode benchmark (tokens/s) =="
timeout 130 "$PY" - <<'EOF'
import json, random, time, torch
from pathlib import Path
from kvpilot.engine import Engine, SamplingParams
from kvpilot.model.checkpoints import make_checkpoint

path = Path.home() / ".cache" / "kvpilot" / "bench" / "llama-100m"
if not (path / "config.json").exists():
    make_checkpoint("llama", path, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                    num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
                    max_position_embeddings=4096)
figures = {}
for attention, graphs in (("torch", False), ("triton", True)):
    engine = Engine.from_pretrained(str(path), device="cuda", attention=attention,
                                    cuda_graphs=graphs, kv_memory_bytes=4 << 30,
                                    max_num_batched_tokens=16384, max_prefill_chunk=16384)
    for batch in (1, 8, 32):
        prompts = [[random.Random(i).randrange(3, 30000) for _ in range(512)] for i in range(batch)]
        def run(n):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            outs = engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
            torch.cuda.synchronize()
            assert all(o.generated_tokens == n for o in outs)
            return time.perf_counter() - t0
        run(4); engine.kv.radix.evict(engine.kv.device.num_blocks)
        prefill = run(1); engine.kv.radix.evict(engine.kv.device.num_blocks)
        total = run(65); engine.kv.radix.evict(engine.kv.device.num_blocks)
        rate = batch * 64 / (total - prefill)
        figures[f"{attention}_decode_tok_s_b{batch}"] = round(rate, 1)
        print(f"{attention:<7} graphs={graphs!s:<5} batch {batch:>2}: decode {rate:9.1f} tok/s, "
              f"prefill {batch * 512 / prefill:9.0f} tok/s", flush=True)
print(json.dumps(figures))
EOF
