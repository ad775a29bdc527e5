"""Radix prefix cache benchmark: a synthetic agent workload, then timings on a warm tree.

    python benchmarks/bench_radix.py [--quick]

Workload: sessions share a 4k-token system prompt, run tens of turns (tool output in, model
output out) until their context reaches 32k tokens, sometimes fork, and release their KV
between turns (a tool pause with the drop-to-cache policy), on a device pool far smaller
than the working set so eviction runs all the time. Then, on a warm tree of 32k-token
sessions: microseconds per match of a 32k prompt, per insert of a turn's 2k new tokens,
leaf evictions per second, and tracemalloc bytes of Python memory per cached block.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
import tracemalloc
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from rich.console import Console
from rich.table import Table

from kvpilot.errors import OutOfBlocks
from kvpilot.memory import BlockPool, KVConfig, KVManager, RadixCache, Tier

BLOCK = 16
SYSTEM_TOKENS = 4096
CONTEXT_TOKENS = 32768
TURN_TOKENS = 2048
GOALS = {"match_us_32k": 200.0, "insert_us_2k": 300.0, "bytes_per_block": 250.0}


def rand_tokens(rng: random.Random, n: int) -> array:
    seed = rng.getrandbits(64)
    ids = np.random.default_rng(seed).integers(1, 150_000, n, dtype=np.int32)
    return array("i", ids.tobytes())


def median_us(samples_ns: list[int]) -> float:
    return statistics.median(samples_ns) / 1000.0


@dataclass(frozen=True, slots=True)
class WorkloadResult:
    sessions: int
    turns: int
    forks: int
    seconds: float
    hit_rate: float
    evicted_blocks: int
    reuse_us: float
    commit_us: float
    nodes: int
    admission_failures: int


def run_workload(sessions: int, max_turns: int, pool_blocks: int, seed: int = 0) -> WorkloadResult:
    rng = random.Random(seed)
    mgr = KVManager(KVConfig(block_size=BLOCK, num_device_blocks=pool_blocks))
    system = rand_tokens(rng, SYSTEM_TOKENS)
    trajs = [mgr.open_trajectory(tokens=system) for _ in range(sessions)]
    reuse_ns: list[int] = []
    commit_ns: list[int] = []
    turns = forks = failures = 0
    start = time.perf_counter()
    for _ in range(max_turns):
        order = list(trajs)
        rng.shuffle(order)
        for traj in order:
            incoming = rng.randint(200, 1200)
            output = rng.randint(100, 600)
            if len(traj.tokens) + incoming + output > CONTEXT_TOKENS:
                continue
            traj.append_tokens(rand_tokens(rng, incoming))
            t0 = time.perf_counter_ns()
            traj.reuse_prefix()
            reuse_ns.append(time.perf_counter_ns() - t0)
            try:
                todo = len(traj.tokens) - traj.num_computed_tokens
                traj.allocate(todo)
                traj.mark_computed(todo)
                decoded = rand_tokens(rng, output)
                for pos in range(0, output, BLOCK):  # decode, committing each full block
                    chunk = decoded[pos : pos + BLOCK]
                    traj.append_tokens(chunk)
                    traj.allocate(len(chunk))
                    traj.mark_computed(len(chunk))
                    t0 = time.perf_counter_ns()
                    traj.commit()
                    commit_ns.append(time.perf_counter_ns() - t0)
            except OutOfBlocks:
                failures += 1
                traj.release_kv()
                continue
            t0 = time.perf_counter_ns()
            traj.finish_turn()
            commit_ns.append(time.perf_counter_ns() - t0)
            turns += 1
            if rng.random() < 0.05:
                try:
                    child = traj.fork().child
                except OutOfBlocks:
                    failures += 1
                else:
                    forks += 1
                    child.append_tokens(rand_tokens(rng, 300))
                    child.reuse_prefix()
                    try:
                        child.allocate(len(child.tokens) - child.num_computed_tokens)
                        child.mark_computed(len(child.tokens) - child.num_computed_tokens)
                    except OutOfBlocks:
                        failures += 1
                    child.close()
            traj.release_kv()
    seconds = time.perf_counter() - start
    mgr.check_invariants()
    nodes = mgr.radix.num_nodes
    for traj in trajs:
        traj.close()
    return WorkloadResult(
        sessions=sessions,
        turns=turns,
        forks=forks,
        seconds=seconds,
        hit_rate=mgr.radix.stats.hit_rate,
        evicted_blocks=mgr.radix.stats.evicted_blocks,
        reuse_us=median_us(reuse_ns),
        commit_us=median_us(commit_ns),
        nodes=nodes,
        admission_failures=failures,
    )


@dataclass(slots=True)
class WarmTree:
    radix: RadixCache
    contexts: list[array]


def build_tree(
    sessions: int, context: int, turn: int, seed: int = 1, spare_blocks: int = 0
) -> WarmTree:
    """Sessions sharing the system prompt, each inserted turn by turn up to ``context`` tokens."""
    rng = random.Random(seed)
    system = rand_tokens(rng, SYSTEM_TOKENS)
    contexts = [system + rand_tokens(rng, context - SYSTEM_TOKENS) for _ in range(sessions)]
    radix = RadixCache(BLOCK, _pools(sessions * context // BLOCK + spare_blocks + 64))
    _grow(radix, contexts, context, turn)
    return WarmTree(radix, contexts)


def _pools(num_blocks: int) -> dict[Tier, BlockPool]:
    return {Tier.DEVICE: BlockPool(num_blocks)}


def _grow(radix: RadixCache, contexts: list[array], context: int, turn: int) -> None:
    pool = radix.pools[Tier.DEVICE]
    for tokens in contexts:
        table: list[int] = []
        for end in range(SYSTEM_TOKENS, context + 1, turn):
            new = pool.allocate(end // BLOCK - len(table))
            table = radix.insert(tokens[:end], table + new).blocks
            pool.free(new)


def time_match(tree: WarmTree, rounds: int) -> tuple[float, float]:
    radix = tree.radix
    arr_ns: list[int] = []
    list_ns: list[int] = []
    as_lists = [ctx.tolist() for ctx in tree.contexts]
    for _ in range(rounds):
        for ctx, as_list in zip(tree.contexts, as_lists, strict=True):
            t0 = time.perf_counter_ns()
            result = radix.match(ctx, record=False)
            arr_ns.append(time.perf_counter_ns() - t0)
            assert result.num_tokens == len(ctx)
            t0 = time.perf_counter_ns()
            radix.match(as_list, record=False)
            list_ns.append(time.perf_counter_ns() - t0)
    return median_us(arr_ns), median_us(list_ns)


def time_insert(sessions: int, seed: int = 2) -> tuple[float, float, float]:
    """A 2k-token turn on a cached 30k context: full-prefix insert, commit path, lazy hashes."""
    spare = sessions * 2 * TURN_TOKENS // BLOCK
    tree = build_tree(sessions, CONTEXT_TOKENS - TURN_TOKENS, TURN_TOKENS, seed, spare)
    radix = tree.radix
    pool = radix.pools[Tier.DEVICE]
    rng = random.Random(seed)
    full_ns: list[int] = []
    below_ns: list[int] = []
    hash_ns: list[int] = []
    for ctx in tree.contexts:
        cached_end = radix.match(ctx, record=False).node
        grown = ctx + rand_tokens(rng, TURN_TOKENS)
        blocks = pool.allocate(TURN_TOKENS // BLOCK)
        table = [0] * (len(ctx) // BLOCK) + blocks
        t0 = time.perf_counter_ns()
        result = radix.insert(grown, table)
        full_ns.append(time.perf_counter_ns() - t0)
        assert result.num_new_blocks == len(blocks)
        assert cached_end.hashes  # the path's hashes, as a router that published them has
        turn2 = rand_tokens(rng, TURN_TOKENS)
        blocks2 = pool.allocate(TURN_TOKENS // BLOCK)
        t0 = time.perf_counter_ns()
        leaf = radix.insert_below(cached_end, turn2, blocks2).node
        below_ns.append(time.perf_counter_ns() - t0)
        t0 = time.perf_counter_ns()
        assert len(leaf.hashes) == 16 * len(blocks2)
        hash_ns.append(time.perf_counter_ns() - t0)
    return median_us(full_ns), median_us(below_ns), median_us(hash_ns)


def time_evictions(tree: WarmTree) -> tuple[float, float]:
    radix = tree.radix
    nodes = radix.num_nodes
    blocks = radix.cached_blocks()
    t0 = time.perf_counter()
    while radix.evict(TURN_TOKENS // BLOCK):
        pass
    seconds = time.perf_counter() - t0
    evicted_nodes = nodes - radix.num_nodes
    return evicted_nodes / seconds, blocks / seconds


def bytes_per_block(sessions: int, turn: int, seed: int = 3) -> tuple[float, int]:
    rng = random.Random(seed)
    system = rand_tokens(rng, SYSTEM_TOKENS)
    contexts = [system + rand_tokens(rng, CONTEXT_TOKENS - SYSTEM_TOKENS) for _ in range(sessions)]
    pools = _pools(sessions * CONTEXT_TOKENS // BLOCK + 64)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    radix = RadixCache(BLOCK, pools)
    _grow(radix, contexts, CONTEXT_TOKENS, turn)
    for node in radix.iter_nodes():
        assert len(node.hashes) == 16 * node.num_blocks  # count them, as the router would
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    cached = radix.cached_blocks()
    return (after - before) / cached, cached


def measure(quick: bool) -> dict[str, float | int | bool]:
    # 98,304 blocks: the spec's B=16 pool for a 70B model on one 80 GB GPU (Napkin Math 0.3).
    sessions, turns, pool = (40, 12, 12_000) if quick else (300, 40, 98_304)
    wl = run_workload(sessions, turns, pool)
    tree = build_tree(16 if quick else 64, CONTEXT_TOKENS, TURN_TOKENS)
    match_us, match_list_us = time_match(tree, 3 if quick else 10)
    insert_us, insert_below_us, hash_us = time_insert(16 if quick else 64)
    evictions_per_s, evicted_blocks_per_s = time_evictions(tree)
    bpb, bpb_blocks = bytes_per_block(24 if quick else 200, TURN_TOKENS)
    bpb_small, _ = bytes_per_block(4 if quick else 16, 64)
    return {
        "quick": quick,
        "workload_sessions": wl.sessions,
        "workload_turns": wl.turns,
        "workload_forks": wl.forks,
        "workload_seconds": round(wl.seconds, 3),
        "workload_hit_rate": round(wl.hit_rate, 4),
        "workload_evicted_blocks": wl.evicted_blocks,
        "workload_admission_failures": wl.admission_failures,
        "workload_radix_nodes": wl.nodes,
        "reuse_prefix_us_median": round(wl.reuse_us, 1),
        "commit_us_median": round(wl.commit_us, 1),
        "match_us_32k": round(match_us, 1),
        "match_us_32k_list_input": round(match_list_us, 1),
        "insert_us_2k": round(insert_us, 1),
        "insert_below_us_2k": round(insert_below_us, 1),
        "chain_hash_us_2k": round(hash_us, 1),
        "evictions_per_s": round(evictions_per_s),
        "evicted_blocks_per_s": round(evicted_blocks_per_s),
        "bytes_per_block": round(bpb, 1),
        "bytes_per_block_tree_blocks": bpb_blocks,
        "bytes_per_block_64_token_turns": round(bpb_small, 1),
        "goal_match_us_32k": GOALS["match_us_32k"],
        "goal_insert_us_2k": GOALS["insert_us_2k"],
        "goal_bytes_per_block": GOALS["bytes_per_block"],
        "meets_goals": match_us <= GOALS["match_us_32k"]
        and insert_us <= GOALS["insert_us_2k"]
        and bpb <= GOALS["bytes_per_block"],
    }


def render(results: dict[str, float | int | bool], console: Console) -> None:
    table = Table(title="kvpilot radix prefix cache")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("goal", justify="right")
    goals: dict[str, Callable[[], str]] = {
        "match_us_32k": lambda: f"<= {GOALS['match_us_32k']:g}",
        "insert_us_2k": lambda: f"<= {GOALS['insert_us_2k']:g}",
        "bytes_per_block": lambda: f"<= {GOALS['bytes_per_block']:g}",
    }
    for key, value in results.items():
        if key.startswith("goal_"):
            continue
        table.add_row(key, str(value), goals.get(key, lambda: "")())
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run for CI")
    args = parser.parse_args()
    results = measure(args.quick)
    render(results, Console())
    print(json.dumps(results))


if __name__ == "__main__":
    main()
