"""Server benchmark: agent sessions over loopback HTTP against the same workload in-process.

N concurrent sessions (default 16) each run a few chat turns back to back (closed loop:
a session sends its next turn as soon as the previous one ends, resending its history as
the OpenAI client does), from a client process of their own. The same turns then run on
an engine called in-process (no HTTP, no event loop), so the HTTP overhead shows as a
ratio. Reports requests/s, generated tokens/s, p50/p99 time to first token and inter-token
latency, both measured by the caller: the HTTP client between streamed chunks, the
in-process loop between engine steps that gave a request new tokens.

Usage: python benchmarks/bench_server.py [--sessions 16] [--turns 3] [--max-tokens 32]
[--quick]. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import torch

from kvpilot.engine import Engine, SamplingParams
from kvpilot.server import ServerLimits, create_app
from kvpilot.server.background import BackgroundServer

SYSTEM = "You are a coding agent. Use the tools you are given, think step by step. " * 3


@dataclass
class Run:
    wall_s: float = 0.0
    requests: int = 0
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0

    def summary(self) -> dict[str, float]:
        return {
            "requests_per_s": self.requests / self.wall_s,
            "tokens_per_s": self.tokens / self.wall_s,
            "ttft_p50_ms": pct(self.ttft_s, 50) * 1e3,
            "ttft_p99_ms": pct(self.ttft_s, 99) * 1e3,
            "itl_p50_ms": pct(self.itl_s, 50) * 1e3,
            "itl_p99_ms": pct(self.itl_s, 99) * 1e3,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
        }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def user_message(session: int, turn: int) -> str:
    rng = random.Random(session * 1000 + turn)
    return f"Session {session}, step {turn}: " + " ".join(
        rng.choice(["ls", "grep", "cat", "pytest", "edit", "diff"]) for _ in range(12)
    )


def make_engine(kv_blocks: int) -> Engine:
    return Engine.from_pretrained("tiny", kv_blocks=kv_blocks)


# -- over HTTP -----------------------------------------------------------------------------


async def http_session(
    client: openai.AsyncOpenAI, base: str, index: int, turns: int, max_tokens: int, run: Run
) -> None:
    async with httpx.AsyncClient(base_url=base) as http:
        sid = (await http.post("/v1/sessions")).json()["id"]
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        for turn in range(turns):
            messages.append({"role": "user", "content": user_message(index, turn)})
            start = time.perf_counter()
            stream = await client.chat.completions.create(
                model="tiny",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"session_id": sid, "ignore_eos": True},
            )
            text, last, usage = "", None, None
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].delta.content:
                    if last is None:
                        run.ttft_s.append(now - start)
                    else:
                        run.itl_s.append(now - last)
                    last = now
                    text += chunk.choices[0].delta.content
                usage = chunk.usage or usage
            assert usage is not None
            run.requests += 1
            run.tokens += usage.completion_tokens
            run.prompt_tokens += usage.prompt_tokens
            run.cached_tokens += usage.prompt_tokens_details.cached_tokens or 0
            messages.append({"role": "assistant", "content": text})
        await http.delete(f"/v1/sessions/{sid}")


async def drive(
    base: str, sessions: int, turns: int, max_tokens: int, run: Run, offset: int
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0)
    await asyncio.gather(
        *(http_session(client, base, offset + i, turns, max_tokens, run) for i in range(sessions))
    )
    await client.close()


def client_process(base: str, sessions: int, turns: int, max_tokens: int, offset: int) -> Run:
    """The clients, in their own process: they do not compete with the server for its GIL."""
    run = Run()
    start = time.perf_counter()
    asyncio.run(drive(base, sessions, turns, max_tokens, run, offset))
    run.wall_s = time.perf_counter() - start
    return run


def run_http(sessions: int, turns: int, max_tokens: int, kv_blocks: int) -> Run:
    app = create_app(make_engine(kv_blocks), limits=ServerLimits(max_sessions_per_tenant=1024))
    with (
        BackgroundServer(app) as server,
        ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool,
    ):
        pool.submit(client_process, server.base_url, 2, 1, max_tokens, 10_000).result()  # warm-up
        return pool.submit(client_process, server.base_url, sessions, turns, max_tokens, 0).result()


# -- in-process ----------------------------------------------------------------------------


def drive_in_process(
    engine: Engine, sessions: int, turns: int, max_tokens: int, offset: int
) -> Run:
    """The HTTP workload's closed loop, on the engine directly (the server's turn rule too)."""
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def prompt_ids(messages: list[dict[str, Any]]) -> list[int]:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tok.encode(text, add_special_tokens=False))

    run = Run()
    live = [engine.open_session() for _ in range(sessions)]
    convo: list[list[dict[str, Any]]] = [[{"role": "system", "content": SYSTEM}] for _ in live]
    turn_of = [0] * sessions
    pending: dict[str, int] = {}
    submitted_at: dict[str, float] = {}
    last_token: dict[str, tuple[float, int]] = {}

    def submit(i: int) -> None:
        convo[i].append({"role": "user", "content": user_message(offset + i, turn_of[i])})
        whole = prompt_ids(convo[i])
        history = live[i].tokens
        if whole[: len(history)] == history and len(whole) > len(history):
            turn = whole[len(history) :]
        else:  # diverged: restart from the whole prompt, as the server does
            live[i].close()
            live[i] = engine.open_session()
            turn = whole
        rid = live[i].submit(turn, params)
        pending[rid] = i
        submitted_at[rid] = time.perf_counter()

    start = time.perf_counter()
    for i in range(sessions):
        submit(i)
    while pending:
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            rid = output.request_id
            count = output.generated_tokens
            previous = last_token.get(rid)
            if previous is None and count:
                run.ttft_s.append(now - submitted_at[rid])
            elif previous is not None and count > previous[1]:
                run.itl_s.append(now - previous[0])
            last_token[rid] = (now, count)
            if not output.finished:
                continue
            i = pending.pop(rid)
            engine.pop_output(rid)
            run.requests += 1
            run.tokens += count
            run.prompt_tokens += output.prompt_tokens
            run.cached_tokens += output.cached_tokens
            convo[i].append({"role": "assistant", "content": output.text})
            turn_of[i] += 1
            if turn_of[i] < turns:
                submit(i)
    run.wall_s = time.perf_counter() - start
    for session in live:
        session.close()
    return run


def run_in_process(sessions: int, turns: int, max_tokens: int, kv_blocks: int) -> Run:
    engine = make_engine(kv_blocks)
    drive_in_process(engine, 2, 1, max_tokens, offset=10_000)  # the same warm-up as HTTP
    return drive_in_process(engine, sessions, turns, max_tokens, offset=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, default=2048)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads for both runs (on a busy CPU, >1 thrashes)",
    )
    parser.add_argument("--quick", action="store_true", help="4 sessions, 2 turns, 8 tokens")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    if args.quick:
        args.sessions, args.turns, args.max_tokens = 4, 2, 8

    http = run_http(args.sessions, args.turns, args.max_tokens, args.kv_blocks).summary()
    local = run_in_process(args.sessions, args.turns, args.max_tokens, args.kv_blocks).summary()
    print(
        f"{args.sessions} sessions x {args.turns} turns, {args.max_tokens} tokens per turn, "
        f"model tiny (CPU, {args.torch_threads} torch threads)"
    )
    columns = ("req/s", "tok/s", "TTFT p50", "p99", "ITL p50", "p99", "hit")
    widths = (9, 9, 10, 9, 9, 9, 7)
    print(f"{'':12}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
    for name, s in (("HTTP", http), ("in-process", local)):
        print(
            f"{name:12}{s['requests_per_s']:9.2f}{s['tokens_per_s']:9.1f}"
            f"{s['ttft_p50_ms']:8.1f}ms{s['ttft_p99_ms']:7.1f}ms"
            f"{s['itl_p50_ms']:7.1f}ms{s['itl_p99_ms']:7.1f}ms{s['hit_rate']:7.1%}"
        )
    ratio = local["tokens_per_s"] / http["tokens_per_s"]
    print(f"HTTP overhead: in-process tokens/s is {ratio:.2f}x the HTTP figure")
    headline = {
        "sessions": args.sessions,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        **{f"http_{k}": round(v, 3) for k, v in http.items()},
        **{f"inproc_{k}": round(v, 3) for k, v in local.items()},
        "inproc_over_http_tokens_per_s": round(ratio, 3),
    }
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
