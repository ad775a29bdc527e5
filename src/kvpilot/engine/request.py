"""Requests and the sequences that run them.

A `Request` is one call (a prompt and its sampling parameters); it runs as one `Sequence`
per branch (``n`` > 1 forks the prompt's trajectory after its prefill). A Sequence drives a
`Trajectory` of the memory core: the trajectory holds the tokens and KV, the sequence holds
what this call has produced and when.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from kvpilot.memory import Trajectory


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int
    request: Request
    traj: Trajectory
    index: int  # branch index within the request (0 .. n-1)
    seed: int
    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    finish_reason: str | None = None
    prefix_reused: bool = False
    num_preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    detok_offset: int = 0  # output tokens already turned into text

    @property
    def num_tokens(self) -> int:
        return len(self.traj.tokens)

    @property
    def remaining_tokens(self) -> int:
        """Tokens whose KV is still to be computed before the next sample."""
        return len(self.traj.tokens) - self.traj.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seed: int
    session_id: str | None = None
    salt: str | None = None
    history_tokens: int = 0  # session tokens before this turn's prompt
    cached_tokens: int = 0  # prefix hit at admission (tokens whose KV was reused)
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # n > 1 branches created
    aborted: bool = False
    resumed: bool = False  # a paused session's next turn
    pause_hint: tuple[float | None, str | None] | None = None  # pause when the turn ends
    cached_by_tier: dict[str, int] = field(
        default_factory=lambda: {"device": 0, "host": 0, "disk": 0}
    )

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1 and self.params.n == 1:
            return seqs[0].status is SeqStatus.FINISHED
        return (
            bool(seqs)
            and all(s.is_finished for s in seqs)
            and (self.forked or self.params.n == 1 or self.aborted)
        )


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A snapshot of a request: what it has produced so far, and whether it is done."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    prompt_tokens: (
        int  # tokens prefilled or reused for this call (history + prompt for a session turn)
    )
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    session_id: str | None = None

    @property
    def generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids if self.outputs else ()
