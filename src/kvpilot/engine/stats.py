"""Counters of the engine's work that a user (and /metrics) can read."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    itl_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def drain_samples(self) -> tuple[list[float], list[float], list[float]]:
        """Hand over (ttft, itl, e2e) samples gathered so far and start new lists."""
        out = (self.ttft_s, self.itl_s, self.e2e_s)
        self.ttft_s, self.itl_s, self.e2e_s = [], [], []
        return out
