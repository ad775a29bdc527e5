"""Sampling parameters of a request (torch-free: the scheduler and simulator use them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    temperature == 0 means greedy. ``seed`` makes sampling reproducible: the token
    sampled at generation step i depends only on (seed, i) and the logits, so forks,
    preemption and recompute never change a seeded result.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise InvalidRequest(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise InvalidRequest(f"n must be a positive integer, got {self.n!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
