"""Provider-style prompt caching on a replay of real agent sessions, through /v1/messages.

The miniswe traces (`../shared/traces/lmcache-agent-trace/miniswe/`) are replayed with the
official `anthropic` client against a `kvpilot` server on loopback (the `tiny` model). Each
call becomes a Messages request: a tool list (a `bash` tool), the system prompt (the task and
the agent's instructions: the head every call of a session repeats) and one user turn (the
history so far), with cache breakpoints after the tools (1h), after the system prompt (1h)
and on the last user turn (5m). Requests of one session share a ``prompt_cache_key``, so
every prefix break is classified. TTLs run on the trace's own clock (the gaps between calls,
times --gap-scale), so a long tool wait lets a 5-minute entry lapse as it would at a provider.

Text is cut to every --shrink-th character (prefix relations are kept: a prompt that extends
another still does) so that sessions fit the tiny model's context.

Three scenarios on the same sessions, each under its own API key (tenant):

* ``clean``: the trace as recorded (append-only: the layout a cache rewards);
* ``timestamp``: a timestamp prepended to the system prompt of every call (the classic
  per-call field at the head);
* ``interleaved``: sessions paired under one cache key, their calls alternating (an
  orchestrator and a sub-agent sharing a session).

Per scenario: requests, prompt tokens, hit rate (cache reads / prompt tokens), tokens
written, billed cost with caching against the same tokens without caching (default prices:
reads 10% of input, writes 125% / 200%), and the causes of prefix breaks found. The last
line is one JSON object.

Usage: python benchmarks/bench_prompt_cache.py [--sessions 4] [--calls 12] [--shrink 4]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx

from kvpilot.engine import Engine
from kvpilot.promptcache.prices import PriceTable
from kvpilot.server import ApiKeys, ServerLimits, create_app
from kvpilot.server.background import BackgroundServer
from kvpilot.server.prompt_cache import PromptCacheConfig
from kvpilot.trace import load_trace_calls

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces" / "lmcache-agent-trace" / "miniswe"
SPLIT = "</instructions>"
TOOLS = [
    {
        "name": "bash",
        "description": "Run one shell command in the repository and return its output.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
        "cache_control": {"type": "ephemeral", "ttl": "1h"},
    }
]
SCENARIOS = ("clean", "timestamp", "interleaved")
MAX_PROMPT_TOKENS = 7000  # the tiny model's context is 8192


@dataclass(frozen=True, slots=True)
class Call:
    key: str  # prompt_cache_key: the session (or the pair sharing one)
    at_s: float  # trace time
    system: str
    history: str


@dataclass(slots=True)
class Clock:
    t: float = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass(slots=True)
class Result:
    requests: int = 0
    prompt: int = 0
    read: int = 0
    written: int = 0
    uncached: int = 0
    output: int = 0
    causes: Counter[str] = field(default_factory=Counter)
    cost: float = 0.0
    cost_without: float = 0.0
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.read / self.prompt if self.prompt else 0.0


def load_calls(n_sessions: int, n_calls: int, shrink: int, gap_scale: float) -> list[list[Call]]:
    sessions = []
    for trace in load_trace_calls(TRACES)[:n_sessions]:
        calls = []
        t0 = trace.calls[0].timestamp_s
        for c in trace.calls[:n_calls]:
            cut = c.input.find(SPLIT)
            cut = len(c.input) if cut < 0 else cut + len(SPLIT)
            # Each part thinned on its own: the head stays equal, the history append-only.
            system, history = c.input[:cut][::shrink], "Begin.\n" + c.input[cut:][::shrink]
            if len(system) + len(history) > MAX_PROMPT_TOKENS:
                break
            at = (c.timestamp_s - t0) * gap_scale
            calls.append(Call(trace.session_id, at, system, history))
        sessions.append(calls)
    return sessions


def scenario(name: str, sessions: list[list[Call]]) -> Iterator[Call]:
    """The calls of a scenario in the order they are sent (trace time within a key)."""
    if name == "interleaved":
        for a, b in zip(sessions[::2], sessions[1::2], strict=False):
            key = f"{a[0].key[:8]}+{b[0].key[:8]}" if a and b else "pair"
            for x, y in zip(a, b, strict=False):
                yield Call(key, x.at_s, x.system, x.history)
                yield Call(key, y.at_s, y.system, y.history)
        return
    for calls in sessions:
        for c in calls:
            if name == "timestamp":
                stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(1.75e9 + c.at_s))
                c = Call(c.key, c.at_s, f"Current time: {stamp}\n{c.system}", c.history)
            yield c


def run(name: str, calls: list[Call], url: str, clock: Clock, prices: PriceTable) -> Result:
    client = anthropic.Anthropic(base_url=url, api_key=f"key-{name}", max_retries=0)
    result = Result()
    base: dict[str, float] = {}
    offset = 0.0
    started = time.perf_counter()
    for c in calls:
        # Each key's calls keep their own trace spacing; keys follow one another.
        first = base.setdefault(c.key, offset - c.at_s)
        clock.t = max(clock.t, first + c.at_s)
        offset = clock.t + 1.0
        raw = client.messages.with_raw_response.create(
            model="tiny",
            max_tokens=1,
            tools=TOOLS,  # type: ignore[arg-type]
            system=[
                {
                    "type": "text",
                    "text": c.system,
                    "cache_control": {"type": "ephemeral", "ttl": "1h"},
                }
            ],
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": c.history, "cache_control": {"type": "ephemeral"}}
                    ],
                }
            ],
            extra_body={"temperature": 0.0, "prompt_cache_key": c.key},
        )
        brk = raw.headers.get("x-kvpilot-prefix-break")
        if brk:
            result.causes[brk.split(";")[0].removeprefix("cause=")] += 1
        u = raw.parse().usage
        result.requests += 1
        result.read += u.cache_read_input_tokens
        result.written += u.cache_creation_input_tokens
        result.uncached += u.input_tokens
        result.prompt += u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
        result.output += u.output_tokens
    result.wall_s = time.perf_counter() - started
    totals = httpx.get(
        f"{url}/v1/usage", params={"start": 0}, headers={"x-api-key": f"key-{name}"}
    ).json()["totals"]
    result.cost = totals["cost"]
    p = prices.for_model("tiny")
    result.cost_without = (result.prompt * p.input + result.output * p.output) / 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--calls", type=int, default=12, help="calls per session, at most")
    parser.add_argument("--shrink", type=int, default=4, help="keep every Nth character")
    parser.add_argument("--gap-scale", type=float, default=100.0, help="tool waits x this")
    parser.add_argument("--min-tokens", type=int, default=1024, help="shortest cached prefix")
    args = parser.parse_args()
    sessions = [s for s in load_calls(args.sessions, args.calls, args.shrink, args.gap_scale) if s]
    engine = Engine.from_pretrained("tiny", kv_blocks=8192, max_model_len=8192)
    clock = Clock()
    prices = PriceTable()
    config = PromptCacheConfig(min_cacheable_tokens=args.min_tokens, clock=clock, prices=prices)
    keys = ApiKeys({f"key-{s}": s for s in SCENARIOS})
    app = create_app(
        engine, model_name="tiny", limits=ServerLimits(max_tokens_limit=8), api_keys=keys,
        prompt_cache=config,
    )  # fmt: skip
    results: dict[str, Result] = {}
    with BackgroundServer(app) as server:
        for name in SCENARIOS:
            results[name] = run(
                name, list(scenario(name, sessions)), server.base_url, clock, prices
            )
    header = (
        f"{'scenario':<12} {'reqs':>5} {'prompt tok':>11} {'hit rate':>9} {'written':>9} "
        f"{'cost':>9} {'no cache':>9} {'saved':>7}  causes"
    )
    print(
        f"{len(sessions)} miniswe sessions, <= {args.calls} calls each, text 1/{args.shrink}, "
        f"tool waits x{args.gap_scale:g}; breakpoints: tools 1h, system 1h, last user turn 5m"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        causes = ", ".join(f"{k} {v}" for k, v in r.causes.most_common()) or "-"
        saved = 1 - r.cost / r.cost_without if r.cost_without else 0.0
        print(
            f"{name:<12} {r.requests:>5} {r.prompt:>11,} {r.hit_rate:>9.1%} {r.written:>9,} "
            f"{r.cost:>9.5f} {r.cost_without:>9.5f} {saved:>7.1%}  {causes}"
        )
    summary: dict[str, Any] = {
        "benchmark": "prompt_cache",
        "sessions": len(sessions),
        "requests": sum(r.requests for r in results.values()),
    }
    for name, r in results.items():
        summary[name] = {
            "hit_rate": round(r.hit_rate, 4),
            "cost": round(r.cost, 6),
            "cost_without_caching": round(r.cost_without, 6),
            "cost_ratio": round(r.cost / r.cost_without, 4) if r.cost_without else None,
            "causes": dict(r.causes),
            "wall_s": round(r.wall_s, 1),
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
