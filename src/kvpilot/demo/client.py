"""An agent-style client for `kvpilot serve`, on the official `openai` client.

An agent session is a script of turns. Each turn sends only what the agent appends to its
context (the task first, then each tool's output) on a server session
(``session_history: "append"``), and, when the agent then runs a tool, says so with
``expected_tool_wait_s`` and ``tool``: the server pauses the session when the turn ends.
The client then waits that long (the tool "runs") and sends the next turn. Sessions run
concurrently, one thread each.

Scripts come from the recorded miniswe traces (the tool after each call is the command in
the call's output; the wait is the gap to the next call, time-compressed), or from a
built-in synthetic agent when the traces are not there.
"""

from __future__ import annotations

import contextlib
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from kvpilot.errors import ConfigError
from kvpilot.trace import ideal_hits, load_trace_calls

TIERS = ("device", "host", "disk")
_BASH_BLOCK = re.compile(r"```(?:bash|sh)?\s*\n\s*([^\s`]+)")


@dataclass(frozen=True, slots=True)
class AgentTurn:
    text: str  # what this turn appends to the session's context
    tool: str | None = None  # the tool the agent runs after this turn (None: it is done)
    tool_wait_s: float = 0.0  # how long that tool runs


@dataclass(frozen=True, slots=True)
class AgentScript:
    name: str
    turns: tuple[AgentTurn, ...]
    start_s: float = 0.0  # when the agent starts, from the start of the replay


@dataclass(frozen=True, slots=True)
class ScriptBudget:
    """How much of each recorded session to replay, so a turn fits a small model's context.

    Text is clipped by UTF-8 bytes: a byte-level tokenizer makes one token per byte, and
    other tokenizers make fewer.
    """

    sessions: int = 3
    turns: int = 6
    first_bytes: int = 1536
    turn_bytes: int = 384
    time_scale: float = 0.25
    stagger_s: float = 0.4

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1:
            raise ConfigError("replay at least one session of at least one turn")
        if self.first_bytes < 1 or self.turn_bytes < 1:
            raise ConfigError("first_bytes and turn_bytes must be positive")
        if self.time_scale < 0 or self.stagger_s < 0:
            raise ConfigError("time_scale and stagger_s must not be negative")

    def context_tokens(self, max_tokens: int) -> int:
        """The most tokens a session's last turn can hold (byte-level tokenizer)."""
        return self.first_bytes + (self.turns - 1) * self.turn_bytes + self.turns * max_tokens


def clip(text: str, max_bytes: int) -> str:
    return text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")


def tool_of(output: str) -> str:
    """The program an agent's reply runs: the first word of its bash block."""
    match = _BASH_BLOCK.search(output)
    return Path(match.group(1)).name if match else "bash"


def scripts_from_trace(folder: Path, budget: ScriptBudget) -> list[AgentScript]:
    """The first ``budget.sessions`` recorded sessions with at least two calls."""
    recorded = [s for s in load_trace_calls(folder) if len(s.calls) >= 2]
    if not recorded:
        raise ConfigError(f"no session with two or more calls in {folder}")
    scripts = []
    for index, session in enumerate(recorded[: budget.sessions]):
        calls = session.calls[: budget.turns]
        gaps = session.gaps_s
        turns = []
        for k, call in enumerate(calls):
            if k == 0:
                text = clip(call.input, budget.first_bytes)
            else:
                previous = calls[k - 1].input
                new = call.input[len(previous) :] if call.input.startswith(previous) else call.input
                text = clip(new, budget.turn_bytes)
            last = k == len(calls) - 1
            turns.append(
                AgentTurn(
                    text=text or " ",
                    tool=None if last else tool_of(call.output),
                    tool_wait_s=0.0 if last else gaps[k] * budget.time_scale,
                )
            )
        scripts.append(
            AgentScript(session.session_id[:8], tuple(turns), start_s=index * budget.stagger_s)
        )
    return scripts


SYNTHETIC_WORDS = ("def", "class", "return", "import", "self", "assert", "error", "path", "line")
SYNTHETIC_TOOLS = (("grep", 1.1), ("cat", 0.8), ("pytest", 2.0), ("sed", 0.7), ("git", 0.9))


def synthetic_scripts(budget: ScriptBudget, seed: int = 0) -> list[AgentScript]:
    """A coding agent's sessions: a task, then tool outputs, with miniswe-like tool waits."""
    rng = random.Random(seed)
    words = SYNTHETIC_WORDS
    scripts = []
    for index in range(budget.sessions):
        task = (
            f"<task>Session {index}: the test suite of project-{index} fails. Find the bug, "
            "fix it in a non-test file, and run the tests again.</task>\n"
        )
        filler = " ".join(rng.choice(words) for _ in range(budget.first_bytes // 4))
        turns = [AgentTurn(clip(task + filler, budget.first_bytes))]
        for k in range(1, budget.turns):
            tool, wait_s = SYNTHETIC_TOOLS[(index + k) % len(SYNTHETIC_TOOLS)]
            output = " ".join(rng.choice(words) for _ in range(budget.turn_bytes // 4))
            turns[-1] = AgentTurn(turns[-1].text, tool, wait_s * budget.time_scale)
            turns.append(
                AgentTurn(clip(f"<returncode>0</returncode>\n{output}", budget.turn_bytes))
            )
        scripts.append(AgentScript(f"synth-{index}", tuple(turns), index * budget.stagger_s))
    return scripts


def load_scripts(folder: Path | None, budget: ScriptBudget) -> tuple[list[AgentScript], str]:
    """Scripts from the traces in ``folder`` if it holds any, else synthetic; and which."""
    if folder is not None and folder.is_dir() and any(folder.glob("*.jsonl")):
        return scripts_from_trace(folder, budget), f"miniswe traces in {folder}"
    return synthetic_scripts(budget), "a synthetic coding agent (no traces found)"


@dataclass(frozen=True, slots=True)
class TurnResult:
    script: str
    session_id: str
    turn: int
    sent_at: float  # monotonic seconds
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int]
    completion_tokens: int
    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    tool: str | None
    tool_wait_s: float
    pause: dict[str, Any] | None  # the server's decision when the turn ended on a tool

    @property
    def pause_action(self) -> str | None:
        return None if self.pause is None else str(self.pause.get("action"))

    @property
    def pause_reason(self) -> str | None:
        return None if self.pause is None else str(self.pause.get("reason"))


OnTurn = Callable[[TurnResult], None]


@dataclass(frozen=True, slots=True)
class Verification:
    """Resumed turns recomputed from their tokens: the outputs must match."""

    checked: int
    mismatches: tuple[str, ...]  # one line per turn whose output differed


class AgentClient:
    """Runs agent scripts against a server; ``stop`` ends every session after its turn.

    A turn that gets no answer within ``timeout_s`` fails the replay (a tiny-model turn
    takes seconds: a silent server is stuck, and waiting longer would only hide it).
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "tiny",
        max_tokens: int = 16,
        api_key: str = "kvpilot-demo",
        timeout_s: float = 120.0,
        stop: threading.Event | None = None,
    ) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.stop = stop or threading.Event()
        self.openai = openai.OpenAI(
            base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=timeout_s
        )
        self.http = httpx.Client(
            base_url=base_url, timeout=60.0, headers={"Authorization": f"Bearer {api_key}"}
        )

    def close(self) -> None:
        self.openai.close()
        self.http.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, script: AgentScript, on_turn: OnTurn) -> list[TurnResult]:
        """One agent session, turn by turn, pausing on each tool call; closed at the end."""
        created = self.http.post("/v1/sessions")
        created.raise_for_status()
        session_id = created.json()["id"]
        results: list[TurnResult] = []
        try:
            for index, turn in enumerate(script.turns):
                if self.stop.is_set():
                    break
                result = self._turn(script, session_id, index, turn)
                results.append(result)
                on_turn(result)
                if turn.tool is not None:
                    self.stop.wait(turn.tool_wait_s)
        finally:
            with contextlib.suppress(httpx.HTTPError):
                self.http.delete(f"/v1/sessions/{session_id}")
        return results

    def _turn(
        self, script: AgentScript, session_id: str, index: int, turn: AgentTurn
    ) -> TurnResult:
        extra: dict[str, Any] = {
            "session_id": session_id,
            "session_history": "append",
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if turn.tool is not None:
            extra |= {"expected_tool_wait_s": turn.tool_wait_s, "tool": turn.tool}
        sent = time.monotonic()
        response = self.openai.completions.create(
            model=self.model,
            prompt=turn.text,
            max_tokens=self.max_tokens,
            temperature=0.0,
            extra_body=extra,
        )
        latency = time.monotonic() - sent
        info = (response.model_extra or {})["kvpilot"]
        usage = response.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        by_tier = (usage.prompt_tokens_details.model_extra or {}).get("cached_tokens_by_tier", {})
        return TurnResult(
            script=script.name,
            session_id=session_id,
            turn=index,
            sent_at=sent,
            latency_s=latency,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.prompt_tokens_details.cached_tokens or 0,
            cached_by_tier={t: int(by_tier.get(t, 0)) for t in TIERS},
            completion_tokens=usage.completion_tokens,
            prompt_token_ids=tuple(info["prompt_token_ids"]),
            completion_token_ids=tuple(info["completion_token_ids"][0]),
            tool=turn.tool,
            tool_wait_s=turn.tool_wait_s,
            pause=info.get("pause"),
        )

    def verify(self, results: Sequence[TurnResult]) -> Verification:
        """Recompute every resumed turn (each after a session's first) and compare.

        The turn's whole prompt goes again as token ids, as a plain request under a cache salt
        of the session's own: none of the session's KV is reused (a turn only reuses the
        recompute of the session's previous turn, computed from tokens, never paused or
        moved). Tokens are the truth: greedy decoding from them must give the same output
        whatever the server did with the session's KV.
        """
        mismatches = []
        resumed = sorted((r for r in results if r.turn > 0), key=lambda r: (r.script, r.turn))
        for r in resumed:
            response = self.openai.completions.create(
                model=self.model,
                prompt=list(r.prompt_token_ids),
                max_tokens=len(r.completion_token_ids),
                temperature=0.0,
                extra_body={
                    "cache_salt": f"kvpilot-demo-recompute-{r.session_id}",
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            again = tuple((response.model_extra or {})["kvpilot"]["completion_token_ids"][0])
            if again != r.completion_token_ids:
                mismatches.append(
                    f"{r.script} turn {r.turn + 1}: {list(r.completion_token_ids)} resumed, "
                    f"{list(again)} recomputed"
                )
        return Verification(len(resumed), tuple(mismatches))

    def replay(self, scripts: Sequence[AgentScript], on_turn: OnTurn) -> list[TurnResult]:
        """All scripts at once, each starting at its ``start_s``; results in sending order.

        The first failing session stops the others and its error is raised. On any way out
        but success (an error, Ctrl-C) the client's connections are closed, so no agent
        thread is left waiting on a reply, and the server aborts what they had asked for.
        """
        results: list[list[TurnResult]] = [[] for _ in scripts]
        errors: list[BaseException] = []

        def agent(index: int, script: AgentScript) -> None:
            try:
                if not self.stop.wait(script.start_s):
                    results[index] = self.run(script, on_turn)
            except BaseException as exc:
                if not self.stop.is_set():
                    errors.append(exc)
                self.stop.set()

        threads = [
            threading.Thread(target=agent, args=(i, s), name=f"agent-{i}", daemon=True)
            for i, s in enumerate(scripts)
        ]
        finished = False
        try:
            for thread in threads:
                thread.start()
            while not errors and any(t.is_alive() for t in threads):
                time.sleep(0.05)  # short sleeps: Ctrl-C gets through
            if errors:
                raise errors[0]
            finished = True
        finally:
            self.stop.set()
            if not finished:
                self.close()
                for thread in threads:
                    thread.join(5.0)
        return sorted((r for rs in results for r in rs), key=lambda r: r.sent_at)


def ideal_hit_rate_of(results: Sequence[TurnResult], block_size: int) -> float:
    """The hit rate of these turns, in the order they were sent, with unlimited memory.

    Two ways to reuse KV, and the ideal takes the better one per turn: the prefix cache
    (`kvpilot.trace.ideal_hits` over the whole prompts, block-aligned; a turn's output
    counts as seen once it is sent, since the engine computes and caches the KV of the
    tokens it generates, all but the last), and the session's own retained KV,
    token-exact up to that last output token.
    """
    ordered = sorted(results, key=lambda r: r.sent_at)
    calls: list[tuple[int, ...]] = []
    for r in ordered:
        calls += [r.prompt_token_ids, (r.prompt_token_ids + r.completion_token_ids)[:-1]]
    cached = ideal_hits(calls, block_size)[0::2]
    context: dict[str, tuple[int, ...]] = {}  # session -> its KV-computed tokens
    hits = 0
    for r, hit in zip(ordered, cached, strict=True):
        own = context.get(r.session_id, ())
        if own and r.prompt_token_ids[: len(own)] == own:
            hit = max(hit, min(len(own), len(r.prompt_token_ids) - 1))
        hits += hit
        context[r.session_id] = (r.prompt_token_ids + r.completion_token_ids)[:-1]
    total = sum(len(r.prompt_token_ids) for r in ordered)
    return hits / total if total else 0.0
