"""Agent replay through an HTTP server: real miniswe sessions, the same token ids for every server.

Each session sends its calls one after another (closed loop; the trace's gap to the next
call, scaled, passes as tool time between them); sessions run concurrently. A call's prompt
is its recorded input, tokenized once by the benchmark's tokenizer and sent as token ids to
``/v1/completions`` (greedy, EOS ignored, a fixed number of new tokens). kvpilot also gets
its agent hints (``session_id``, ``expected_tool_wait_s``), which a vLLM server has no use
for; the tokens are the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvpilot.trace import ideal_hit_rate, load_trace_calls


@dataclass(frozen=True, slots=True)
class ReplayCall:
    session: str
    tokens: tuple[int, ...]
    wait_s: float  # tool time after this call, before the session's next one


@dataclass(frozen=True, slots=True)
class ReplayResult:
    calls: int
    wall_s: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.wall_s

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def load_calls(
    traces: Path, tokenizer: object, sessions: int, max_prompt_tokens: int, wait_scale: float
) -> list[list[ReplayCall]]:
    """The first ``sessions`` sessions' calls as token ids; calls over the context cap dropped."""
    out: list[list[ReplayCall]] = []
    for session in load_trace_calls(traces)[:sessions]:
        calls: list[ReplayCall] = []
        recorded = list(session.calls)
        for index, call in enumerate(recorded):
            tokens = tokenizer.encode(call.input, add_special_tokens=False)  # type: ignore[attr-defined]
            if len(tokens) > max_prompt_tokens:
                continue
            nxt = recorded[index + 1] if index + 1 < len(recorded) else None
            gap = (nxt.timestamp_s - call.timestamp_s) if nxt is not None else 0.0
            calls.append(ReplayCall(session.session_id, tuple(tokens), max(gap, 0.0) * wait_scale))
        if calls:
            out.append(calls)
    return out


def working_set_tokens(sessions: Sequence[Sequence[ReplayCall]]) -> int:
    """Tokens that would have to stay resident for every session to keep its whole context."""
    return sum(max(len(c.tokens) for c in calls) for calls in sessions)


def ideal(sessions: Sequence[Sequence[ReplayCall]], block_size: int) -> float:
    order = [c.tokens for calls in sessions for c in calls]
    return ideal_hit_rate(order, block_size)


async def _session(
    client: httpx.AsyncClient,
    model: str,
    calls: Sequence[ReplayCall],
    max_tokens: int,
    agent_hints: bool,
    totals: list[int],
) -> None:
    session_id = None
    if agent_hints:  # a kvpilot session per trace session (the server picks its id)
        created = await client.post("/v1/sessions", json={})
        created.raise_for_status()
        session_id = created.json()["id"]
    for call in calls:
        body: dict[str, object] = {
            "model": model,
            "prompt": list(call.tokens),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        if session_id is not None:
            body["session_id"] = session_id
            body["expected_tool_wait_s"] = call.wait_s
        response = await client.post("/v1/completions", json=body)
        response.raise_for_status()
        usage = response.json()["usage"]
        generated = usage["completion_tokens"]
        if generated != max_tokens:
            raise AssertionError(f"server produced {generated} tokens, asked for {max_tokens}")
        totals[0] += 1
        totals[1] += usage["prompt_tokens"]
        totals[2] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        await asyncio.sleep(call.wait_s)


async def replay(
    base_url: str,
    model: str,
    sessions: Sequence[Sequence[ReplayCall]],
    max_tokens: int,
    agent_hints: bool,
) -> ReplayResult:
    totals = [0, 0, 0]
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(1800.0)) as client:
        start = time.perf_counter()
        await asyncio.gather(
            *(_session(client, model, s, max_tokens, agent_hints, totals) for s in sessions)
        )
        wall = time.perf_counter() - start
    expected = sum(len(s) for s in sessions)
    if totals[0] != expected:
        raise AssertionError(f"{totals[0]} of {expected} calls completed")
    return ReplayResult(totals[0], wall, totals[1], totals[2])


KVPILOT_COUNTERS = (
    "kvpilot_preemptions_total",
    "kvpilot_preemptions_swapped_total",
    "kvpilot_admissions_deferred_total",
    "kvpilot_prefill_tokens_total",
    "kvpilot_kv_evicted_blocks_total",
    "kvpilot_recomputed_tokens_total",
    "kvpilot_pause_decisions_total",
)


def kvpilot_counters(base_url: str) -> dict[str, float]:
    """A few of kvpilot's /metrics counters (summed over labels; label values kept apart
    for the pause decisions): where a replay's time and cache hits went."""
    text = httpx.get(base_url + "/metrics", timeout=30.0).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        family = name.split("{", 1)[0]
        if family not in KVPILOT_COUNTERS:
            continue
        key = family.removeprefix("kvpilot_").removesuffix("_total")
        if family == "kvpilot_pause_decisions_total":
            key += ":" + name.split('"')[1]
        out[key] = out.get(key, 0.0) + float(value)
    return out


@contextlib.contextmanager
def running_server(
    command: Sequence[str], port: int, env: dict[str, str], log: Path, startup_s: float = 900.0
) -> Iterator[str]:
    """Start a server process, wait until it answers /v1/models, stop it (and its children)."""
    base = f"http://127.0.0.1:{port}"
    with open(log, "w", encoding="utf-8") as out:
        process = subprocess.Popen(
            list(command),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + startup_s
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{command[0]} exited ({process.returncode}); see {log}")
                try:
                    if httpx.get(base + "/v1/models", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start in {startup_s:.0f} s; see {log}")
                time.sleep(1.0)
            yield base
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 15)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, 9)
                process.wait()
