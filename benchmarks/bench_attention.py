"""CPU routes for the decode hot path, measured side by side (how the `cpu` backend was chosen).

1. Attention of one layer over a paged pool (the 125M shape: 12 heads over 4 KV heads of
   dim 64, block 16), decode at batch 1/8/32 with 512- and 2048-token contexts, and a
   256-token prefill chunk over a 1024-token cached prefix:
   - ``torch``: the reference backend (gathers each padded context, masked SDPA);
   - ``cpu``: the C++/OpenMP kernel reading K/V in place through the block tables;
   - ``flex`` (with ``--flex``): FlexAttention compiled with a paged block mask over the
     whole pool (torch.compile; slow to build, so opt-in).
2. The model's linear layers (all 12 layers of the 125M model plus the LM head) at 1, 8
   and 32 rows: ``F.linear`` against oneDNN with weights reordered once.

CPU time per call (process time, best of several runs) so that other load on the machine
distorts less. Usage: python benchmarks/bench_attention.py [--quick] [--flex]. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from kvpilot.engine.executor import SeqWork
from kvpilot.model.attention import TorchAttention, make_attention_backend
from kvpilot.model.batch import StepBatch
from kvpilot.model.kv_cache import KVCache

HEADS, KV_HEADS, DIM, BLOCK = 12, 4, 64, 16


def cpu_time_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for _ in range(repeats):
            fn()
        best = min(best, (time.process_time() - start) / repeats)
    return best * 1e3


def attention_case(works: list[tuple[int, int]]) -> tuple[StepBatch, KVCache, torch.Tensor, ...]:
    per = -(-max(s + n for s, n in works) // BLOCK)
    geometry = SimpleNamespace(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM)
    cache = KVCache(geometry, per * len(works), BLOCK, torch.float32, torch.device("cpu"))  # type: ignore[arg-type]
    cache.data.normal_()
    order = torch.randperm(per * len(works)).tolist()
    seq_works = [
        SeqWork(i, [1] * n, s, order[i * per : (i + 1) * per]) for i, (s, n) in enumerate(works)
    ]
    batch = StepBatch.build(
        seq_works,
        block_size=BLOCK,
        num_blocks=per * len(works),
        vocab_size=2,
        max_model_len=1 << 20,
        device=torch.device("cpu"),
    )
    t = batch.num_tokens
    q = torch.randn(t, HEADS, DIM)
    k, v = torch.randn(t, KV_HEADS, DIM), torch.randn(t, KV_HEADS, DIM)
    return batch, cache, q, k, v


def flex_route() -> Callable[[StepBatch, KVCache, torch.Tensor], torch.Tensor]:
    """Decode through FlexAttention: queries attend to the whole pool under a paged mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)

    def run(batch: StepBatch, cache: KVCache, q: torch.Tensor) -> torch.Tensor:
        pool = cache.data.shape[2] * BLOCK
        owner = torch.full((cache.data.shape[2],), -1, dtype=torch.long)
        logical = torch.zeros_like(owner)
        for row, table in enumerate(batch.block_tables):
            used = -(-int(batch.context_len[row]) // BLOCK)
            owner[table[:used]] = row
            logical[table[:used]] = torch.arange(used)
        pos = batch.positions

        def mask(
            b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, kv: torch.Tensor
        ) -> torch.Tensor:
            blk = kv // BLOCK
            return (owner[blk] == qi) & (logical[blk] * BLOCK + kv % BLOCK <= pos[qi])

        n = q.shape[0]
        block_mask = create_block_mask(mask, None, None, n, pool, device="cpu", BLOCK_SIZE=BLOCK)
        keys = cache.keys(0).reshape(1, pool, KV_HEADS, DIM).transpose(1, 2)
        values = cache.values(0).reshape(1, pool, KV_HEADS, DIM).transpose(1, 2)
        out = compiled(
            q.transpose(0, 1).unsqueeze(0), keys, values, block_mask=block_mask, enable_gqa=True
        )
        return out[0].transpose(0, 1)

    return run


def attention_section(quick: bool, flex: bool) -> dict[str, float]:
    cpu = make_attention_backend("cpu")
    ref = TorchAttention()
    cases = {
        f"decode_b{b}_ctx{c}": [(c, 1)] * b
        for c in ((512,) if quick else (512, 2048))
        for b in (1, 8, 32)
    }
    cases["prefill_16_over_1024"] = [(1024, 16)]
    cases["prefill_64_over_1024"] = [(1024, 64)]
    cases["prefill_256_over_1024"] = [(1024, 256)]
    cases["prefill_512_fresh"] = [(0, 512)]
    routes = ["torch", "cpu", *(["flex"] if flex else [])]
    flex_run = flex_route() if flex else None
    print("\n== Attention, one layer (CPU ms per call) ==")
    print(f"{'case':<24}" + "".join(f"{r:>10}" for r in routes) + f"{'torch/cpu':>11}")
    figures: dict[str, float] = {}
    for name, works in cases.items():
        batch, cache, q, k, v = attention_case(works)
        times: dict[str, float] = {}
        for route in routes:
            if route == "flex":
                if batch.max_query_len != 1:
                    continue
                assert flex_run is not None
                fn: Callable[[], object] = lambda b=batch, c=cache, x=q: flex_run(b, c, x)  # noqa: E731
            else:
                backend = ref if route == "torch" else cpu
                state = backend.prepare(batch, [None])
                fn = lambda b=backend, s=state, a=(q, k, v, cache, batch): b.forward(  # noqa: E731
                    0, *a, s, None
                )
            times[route] = cpu_time_ms(fn, 3 if quick else 10)
        ratio = times["torch"] / times["cpu"]
        cells = "".join(f"{times[r]:>10.2f}" if r in times else f"{'-':>10}" for r in routes)
        print(f"{name:<24}{cells}{ratio:>10.1f}x")
        figures[f"attn_speedup_{name}"] = round(ratio, 2)
    return figures


def linear_section(quick: bool) -> dict[str, float]:
    shapes = [(HEADS * DIM + 2 * KV_HEADS * DIM, 768), (768, 768), (4096, 768), (768, 2048)]
    weights = [torch.randn(s) * 0.03 for s in shapes * 12] + [torch.randn(32000, 768) * 0.03]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
    print("\n== Linear layers of the 125M model (CPU ms per forward) ==")
    print(f"{'rows':>6}{'F.linear':>12}{'oneDNN':>12}{'speedup':>10}")
    figures: dict[str, float] = {}
    for rows in (1, 8, 32):
        inputs = {768: torch.randn(rows, 768), 2048: torch.randn(rows, 2048)}

        def plain(inputs: dict[int, torch.Tensor] = inputs) -> None:
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

        def onednn(inputs: dict[int, torch.Tensor] = inputs) -> None:
            for w, p in zip(weights, packed, strict=True):
                torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")

        a, b = cpu_time_ms(plain, 1 if quick else 3), cpu_time_ms(onednn, 1 if quick else 3)
        print(f"{rows:>6}{a:>12.1f}{b:>12.1f}{a / b:>9.2f}x")
        figures[f"linear_speedup_rows{rows}"] = round(a / b, 2)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run for a smoke test")
    parser.add_argument("--flex", action="store_true", help="also FlexAttention (compiles)")
    args = parser.parse_args()
    torch.manual_seed(0)
    figures: dict[str, float] = {"torch_threads": torch.get_num_threads()}
    figures |= attention_section(args.quick, args.flex)
    figures |= linear_section(args.quick)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
