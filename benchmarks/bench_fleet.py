"""Prefix-aware routing across replicas: kvpilot's router against the baselines.

(a) Simulated: 16 replicas of llama-3-70b on 8xH100 (TP=8) behind each router, on the
    fleet simulator (the routers' own code, KV events delayed 50 ms), under a synthetic
    agent workload: 32 agent families with their own 6k-token system + tool prompts,
    sessions of 6-20 turns whose histories grow by tool observations, tool waits of
    seconds to a minute. Load: a closed loop of agents sized to ~80% of fleet capacity,
    where capacity is measured first: one replica's completed calls per second at
    saturation (a ladder of closed loops), and the agent count whose throughput is 80% of
    it (interpolated on the ladder), times 16.
(b) Real: 3 replicas of `tiny` on a local Ray instance (`kvpilot serve --replicas 3`
    machinery), replaying the miniswe sessions (../shared/traces) as token-id prompts
    with each session's id as ``prompt_cache_key``, all sessions at once; each router gets
    its own front and replicas whose prefix caches were just reset.

Per router: prefix hit rate (cached prompt tokens / prompt tokens, as the engines report),
the ideal (one infinite cache over the same requests), p50/p99 TTFT, imbalance (max over
mean of the tokens each replica computed). ``--study`` also sweeps the kvpilot router's
mu, gamma and L_max on a smaller simulated fleet (the defaults in `RouterConfig` come
from it). Timings are CPU- and machine-dependent; the simulated figures are not.

Usage: python benchmarks/bench_fleet.py [--quick] [--skip-real] [--skip-sim] [--study]
The last line printed is one JSON object:
{"sim": {"ideal_hit_rate", "routers": {NAME: {"hit_rate", "p99_ttft_s", "imbalance"}}},
 "real": {...}}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvpilot.engine.config import EngineConfig
from kvpilot.fleet.routers import ROUTER_NAMES
from kvpilot.fleet.scoring import RouterConfig
from kvpilot.fleet.sim_report import FleetResult
from kvpilot.fleet.sim_run import run_fleet
from kvpilot.sim.build import SimSetup
from kvpilot.sim.workload import WorkloadConfig

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces" / "lmcache-agent-trace" / "miniswe"

WORKLOAD = """\
name: fleet-agents
seed: 7
arrival: {{concurrent: {agents}, ramp_s: {ramp}}}
trajectory:
  turns: {{dist: uniform, low: 6, high: 20}}
  task_tokens: {{dist: lognormal, median: 800, sigma: 0.5, max: 4000}}
  observation_tokens: {{dist: lognormal, median: 900, sigma: 0.9, max: 8000}}
  output_tokens: {{dist: lognormal, median: 60, sigma: 0.6, min: 8, max: 600}}
  max_context_tokens: 48000
shared_prefix: {{system_tokens: 3000, tool_tokens: 3000}}
tools:
  bash: {{weight: 0.7, wait: {{dist: lognormal, median: 1, sigma: 0.8}}}}
  tests: {{weight: 0.28, wait: {{dist: lognormal, median: 8, sigma: 0.6}}}}
  human: {{weight: 0.02, wait: {{dist: lognormal, median: 60, sigma: 0.7}}}}
branching: {{probability: 0.0}}
"""
FAMILIES = 32
ENGINE = EngineConfig.from_kwargs(
    max_num_seqs=256, max_num_batched_tokens=4096, max_prefill_chunk=2048
)


def workload(agents: int, ramp_s: float) -> WorkloadConfig:
    return WorkloadConfig.from_yaml_text(WORKLOAD.format(agents=agents, ramp=ramp_s))


# -- (a) simulated -------------------------------------------------------------------------


def throughput(result: FleetResult, arrivals: np.ndarray, after_s: float) -> float:
    """Calls per second that arrived after ``after_s`` and finished (a steady-state rate)."""
    return float((arrivals >= after_s).sum()) / max(1e-9, result.duration_s - after_s)


def measure_capacity(duration_s: float, ladder: Sequence[int]) -> tuple[float, int, list[str]]:
    """One replica's saturated call rate, and the agents per replica that load it to 80%."""
    setup = SimSetup(duration_s=duration_s, engine=ENGINE)
    rates: list[float] = []
    lines = []
    for agents in ladder:
        from kvpilot.fleet.sim import FleetSimulator
        from kvpilot.fleet.sim_drivers import FleetAgentDriver
        from kvpilot.sim.build import build_engine

        load = workload(agents, duration_s / 6)
        sim = FleetSimulator(
            lambda load=load: build_engine(setup, load.vocab_size)[0], 1, "round_robin",
            duration_s=duration_s,
        )  # fmt: skip
        driver = FleetAgentDriver(load, families=FAMILIES)
        sim.run(driver)
        result = FleetResult.collect(sim, driver.counters())
        rate = throughput(result, np.asarray(sim.log.arrival_s), duration_s / 2)
        rates.append(rate)
        lines.append(
            f"  {agents:4d} agents/replica: {rate:6.2f} calls/s, "
            f"TTFT p99 {result.ttft_percentile(99):.2f} s"
        )
    capacity = max(rates)
    target = 0.8 * capacity
    agents_80 = ladder[-1]
    for i in range(1, len(ladder)):
        if rates[i] >= target:
            lo, hi = ladder[i - 1], ladder[i]
            r0, r1 = rates[i - 1], rates[i]
            frac = (target - r0) / (r1 - r0) if r1 > r0 else 1.0
            agents_80 = max(1, round(lo + frac * (hi - lo)))
            break
    return capacity, agents_80, lines


def simulate(
    replicas: int, agents_per_replica: int, duration_s: float, routers: Sequence[str],
    config: RouterConfig | None = None,
) -> list[FleetResult]:  # fmt: skip
    setup = SimSetup(duration_s=duration_s, engine=ENGINE)
    load = workload(agents_per_replica * replicas, min(60.0, duration_s / 4))
    out = []
    for name in routers:
        t0 = time.process_time()
        result = run_fleet(
            setup, load, replicas=replicas, router=name, families=FAMILIES,
            config=config if name == "kvpilot" else None, event_delay_s=0.05,
        )  # fmt: skip
        out.append(result)
        print(
            f"  {name:13s} hit {result.hit_rate:6.1%} (ideal {result.ideal_hit_rate:6.1%})  "
            f"TTFT p50 {result.ttft_percentile(50):6.3f} s p99 {result.ttft_percentile(99):6.2f} s"
            f"  imbalance {result.imbalance:5.3f}  requests {result.requests:6d}  "
            f"cpu {time.process_time() - t0:5.0f} s",
            flush=True,
        )
    return out


def study(replicas: int, agents: int, duration_s: float) -> list[dict[str, Any]]:
    """mu x gamma at the default L_max, then L_max around it at the default mu and gamma."""
    base = RouterConfig()
    grid = [(mu, gamma, base.l_max_tokens) for mu in (0.5, 0.7, 0.9) for gamma in (1.0, 2.0)]
    grid += [(base.mu, base.gamma, l_max) for l_max in (16384.0, 65536.0)]
    rows = []
    for mu, gamma, l_max in grid:
        config = dataclasses.replace(base, mu=mu, gamma=gamma, l_max_tokens=l_max)
        print(f"mu={mu} gamma={gamma} L_max={l_max:.0f}:", flush=True)
        r = simulate(replicas, agents, duration_s, ["kvpilot"], config)[0]
        rows.append(
            {"mu": mu, "gamma": gamma, "l_max_tokens": l_max,
             "of_ideal": round(r.hit_rate / r.ideal_hit_rate, 4),
             "imbalance": round(r.imbalance, 4),
             "p99_ttft_s": round(r.ttft_percentile(99), 4)}
        )  # fmt: skip
    return rows


def figures(results: Sequence[FleetResult]) -> dict[str, Any]:
    return {
        "ideal_hit_rate": round(results[0].ideal_hit_rate, 4),
        "routers": {
            r.router: {
                "hit_rate": round(r.hit_rate, 4),
                "p50_ttft_s": round(r.ttft_percentile(50), 4),
                "p99_ttft_s": round(r.ttft_percentile(99), 4),
                "imbalance": round(r.imbalance, 4),
            }
            for r in results
        },
    }


# -- (b) real ------------------------------------------------------------------------------


def replay_real(routers: Sequence[str], replicas: int, sessions: int, max_tokens: int) -> dict:  # type: ignore[type-arg]
    import ray
    from ray import serve

    from kvpilot.cli.serve import ServeOptions
    from kvpilot.engine.config import EngineConfig
    from kvpilot.fleet.serve.deploy import FleetOptions, build_applications, run_applications
    from kvpilot.model.loader import resolve_model_path
    from kvpilot.model.tokenizer import load_tokenizer
    from kvpilot.server.process import free_port
    from kvpilot.sim.replay import ReplayOptions, load_replay
    from kvpilot.trace.ideal import ideal_hits

    tok = load_tokenizer(resolve_model_path("tiny"))
    replay = load_replay(
        [TRACES],
        ReplayOptions(
            vocab_size=int(tok.vocab_size),
            tokenize=lambda text: list(tok.encode(text, add_special_tokens=False)),
            head_tokens=600,
            max_call_tokens=1800,
            max_sessions=sessions,
            min_calls=2,
        ),
    )
    calls = [list(c.prompt) for s in replay for c in s.calls]
    total = sum(len(c) for c in calls)
    ideal = sum(ideal_hits(calls, 16)) / total if total else 0.0
    options = ServeOptions(
        model="tiny", engine=EngineConfig.from_kwargs(kv_blocks=160, max_model_len=2048)
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})  # fmt: skip
    results: dict[str, Any] = {"ideal_hit_rate": round(ideal, 4), "routers": {}}
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        fleet = FleetOptions(replicas=replicas, port=port, num_cpus=2, poll_interval_s=0.2)
        apps = build_applications(options, fleet)
        run_applications(apps[:-1])  # the replicas, once for every router
        for name in routers:
            for app_name, _, _ in apps[:-1]:  # every router starts from cold caches
                handle = serve.get_deployment_handle("EngineReplica", app_name=app_name)
                handle.reset_prefix_cache.remote().result()
            front_name, front_prefix, front = build_applications(
                options, dataclasses.replace(fleet, router=name)
            )[-1]
            run_applications([(front_name, front_prefix, front)])
            _wait_healthy(url, replicas)
            stats = _replay_http(url, replay, max_tokens)
            results["routers"][name] = stats
            print(
                f"  {name:13s} hit {stats['hit_rate']:6.1%} (ideal {ideal:6.1%})  "
                f"TTFT p50 {stats['p50_ttft_s']:6.3f} s p99 {stats['p99_ttft_s']:6.2f} s  "
                f"imbalance {stats['imbalance']:5.3f}",
                flush=True,
            )
            serve.delete(front_name)
    finally:
        serve.shutdown()
        ray.shutdown()
    return results


def _wait_healthy(url: str, replicas: int, timeout_s: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=10).json().get("replicas_up") == replicas:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1.0)
    raise RuntimeError("the fleet did not come up")


def _replay_http(url: str, replay: Sequence[Any], max_tokens: int) -> dict[str, float]:
    import httpx

    lock = threading.Lock()
    ttft: list[float] = []
    prompt = cached = 0
    computed: dict[str, int] = {}

    def run_session(session: Any) -> None:
        nonlocal prompt, cached
        with httpx.Client(base_url=url, timeout=600) as client:
            for call in session.calls:
                body = {"prompt": list(call.prompt), "max_tokens": max_tokens, "stream": True,
                        "temperature": 0.0, "ignore_eos": True,
                        "stream_options": {"include_usage": True},
                        "prompt_cache_key": session.session_id}  # fmt: skip
                t0 = time.perf_counter()
                first = None
                usage = None
                with client.stream("POST", "/v1/completions", json=body) as response:
                    replica = response.headers.get("x-kvpilot-replica", "?")
                    for line in response.iter_lines():
                        if not line.startswith("data:") or line.endswith("[DONE]"):
                            continue
                        data = json.loads(line[5:])
                        if first is None and data.get("choices"):
                            first = time.perf_counter() - t0
                        if data.get("usage"):
                            usage = data["usage"]
                if usage is None:
                    continue
                hit = usage["prompt_tokens_details"]["cached_tokens"]
                with lock:
                    ttft.append(first if first is not None else math.nan)
                    prompt += usage["prompt_tokens"]
                    cached += hit
                    work = usage["prompt_tokens"] - hit + usage["completion_tokens"]
                    computed[replica] = computed.get(replica, 0) + work

    threads = [threading.Thread(target=run_session, args=(s,)) for s in replay]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    values = np.asarray(list(computed.values()), dtype=float)
    arr = np.asarray([t for t in ttft if not math.isnan(t)])
    return {
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "p50_ttft_s": round(float(np.percentile(arr, 50)), 4) if len(arr) else math.nan,
        "p99_ttft_s": round(float(np.percentile(arr, 99)), 4) if len(arr) else math.nan,
        "imbalance": round(float(values.max() / values.mean()), 4) if len(values) else 1.0,
        "requests": len(arr),
    }


# -- goals ---------------------------------------------------------------------------------


def check_goals(part: dict[str, Any], label: str, strict: bool) -> list[str]:
    r = part["routers"]
    kv = r.get("kvpilot")
    if kv is None:
        return []
    lines = []

    def goal(ok: bool, text: str) -> None:
        lines.append(f"  [{'ok' if ok else 'MISSED'}] {label}: {text}")

    if strict:
        goal(
            kv["hit_rate"] >= 0.95 * part["ideal_hit_rate"],
            f"hit rate {kv['hit_rate']:.3f} >= 0.95 x ideal {part['ideal_hit_rate']:.3f}",
        )
        goal(kv["imbalance"] <= 1.15, f"imbalance {kv['imbalance']:.3f} <= 1.15")
    for base in ("round_robin", "power_of_two"):
        if base in r:
            ratio = kv["hit_rate"] / max(1e-9, r[base]["hit_rate"])
            goal(ratio >= 1.3 if strict else ratio >= 1.0,
                 f"{ratio:.2f}x the hit rate of {base}")  # fmt: skip
    if "ray_prefix" in r:
        rp = r["ray_prefix"]
        goal(kv["hit_rate"] >= rp["hit_rate"] and kv["p99_ttft_s"] <= rp["p99_ttft_s"],
             f"hit {kv['hit_rate']:.3f} vs ray_prefix {rp['hit_rate']:.3f}, p99 TTFT "
             f"{kv['p99_ttft_s']:.3f} vs {rp['p99_ttft_s']:.3f} s")  # fmt: skip
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 replicas, shorter runs")
    parser.add_argument("--skip-sim", action="store_true")
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--study", action="store_true", help="sweep mu, gamma, L_max")
    parser.add_argument("--replicas", type=int, default=None)
    parser.add_argument("--duration", type=float, default=None, help="simulated seconds")
    parser.add_argument("--sessions", type=int, default=20, help="real: trace sessions")
    parser.add_argument(
        "--agents", type=int, default=None,
        help="sim: agents per replica (skips the capacity ladder; give what it found)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    replicas = args.replicas or (4 if args.quick else 16)
    duration = args.duration or (90.0 if args.quick else 180.0)
    routers = list(ROUTER_NAMES)
    payload: dict[str, Any] = {}
    goals: list[str] = []
    if not args.skip_sim:
        capacity = math.nan
        if args.agents is not None:
            agents = args.agents
            print(f"(a) simulated: {agents} agents per replica, as given (no capacity ladder)")
        else:
            print("(a) simulated: capacity of one llama-3-70b 8xH100 replica (closed loops)")
            ladder = (8, 16, 32, 64, 128) if args.quick else (8, 16, 32, 64, 96, 128, 192)
            capacity, agents, lines = measure_capacity(90.0 if args.quick else 150.0, ladder)
            print("\n".join(lines))
            print(f"  capacity {capacity:.2f} calls/s per replica; 80% at {agents} agents/replica")
        print(f"(a) simulated: {replicas} replicas x {agents} agents, {duration:.0f} s")
        results = simulate(replicas, agents, duration, routers)
        payload["sim"] = figures(results)
        if not math.isnan(capacity):
            payload["sim"]["capacity_calls_per_s"] = round(capacity, 3)
        payload["sim"]["agents"] = agents * replicas
        goals += check_goals(payload["sim"], "sim", strict=True)
        if args.study:
            small = min(replicas, 4)
            print(f"study: {small} replicas x {agents} agents, {duration:.0f} s")
            payload["study"] = study(small, agents, duration)
    if not args.skip_real:
        if not TRACES.is_dir():
            print(f"(b) real: skipped, no traces at {TRACES}", file=sys.stderr)
        else:
            print("(b) real: 3 replicas of tiny on local Ray, miniswe sessions")
            payload["real"] = replay_real(routers, 3, args.sessions, 8)
            goals += check_goals(payload["real"], "real", strict=False)
    if goals:
        print("goals:")
        print("\n".join(goals))
    print(json.dumps(payload))


if __name__ == "__main__":
    main()
