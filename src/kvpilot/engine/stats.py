"""Counters of the engine's work that a user (and /metrics) can read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpilot.engine.request import Request, Sequence


@dataclass(slots=True)
class EngineStats:
    """Counters a user (and /metrics) can read."""

    steps: int = 0
    prefill_tokens: int = 0  # tokens whose KV was computed by prefill chunks
    decode_tokens: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0  # per request: history + prompt at admission
    cached_tokens: int = 0  # per request: prefix hit
    requests_finished: int = 0
    forks: int = 0
    gated_forks: int = 0  # branches deferred to the queue under memory pressure
    fork_copied_blocks: int = 0
    step_time_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    # A token after a sequence's first adds its inter-token latency here and counts in
    # generated_tokens where it is appended (`EngineCore._append_token`, decode runs' `_apply`).
    itl_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def observe_step(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        self.steps += 1
        self.step_time_s += seconds
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += decode_tokens

    def observe_first_token(self, seq: Sequence, now: float) -> None:
        """``seq`` produced its first token at ``now`` (the TTFT of a request's first branch)."""
        seq.first_token_time = seq.last_token_time = now
        if seq.index == 0:
            self.ttft_s.append(now - seq.request.arrival_time)
        self.generated_tokens += 1

    def observe_finished(self, request: Request, now: float) -> None:
        self.requests_finished += 1
        self.prompt_tokens += request.history_tokens + len(request.prompt_ids.ids)
        self.cached_tokens += request.cached_tokens
        self.e2e_s.append(now - request.arrival_time)

    def drain_samples(self) -> tuple[list[float], list[float], list[float]]:
        """Hand over (ttft, itl, e2e) samples gathered so far and start new lists."""
        out = (self.ttft_s, self.itl_s, self.e2e_s)
        self.ttft_s, self.itl_s, self.e2e_s = [], [], []
        return out
