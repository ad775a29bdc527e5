"""What one scheduler step hands the engine: the batch, and who was preempted or starved."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvpilot.engine.executor import SeqWork
from kvpilot.engine.request import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """A running sequence's share of a step, as `SchedulerOutput.scheduled` lists them."""

    seq: Sequence
    num_tokens: int
    sample: bool


class SchedulerOutput(NamedTuple):
    """One step's batch (a named tuple, as `SeqWork`: one is built per step; its fields are
    read through C getters).

    ``seqs[i]`` runs ``works[i]``: its token count is ``len(works[i].token_ids)`` and it
    samples when ``works[i].sampling`` is set (nothing else is built per sequence)."""

    seqs: list[Sequence]
    works: list[SeqWork]
    preempted: list[Sequence]
    starved: list[Sequence]  # cannot grow even alone in the pool: the engine ends them
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    context: int = 0  # the longest context a work reaches: max(start_pos + len(token_ids))

    @property
    def empty(self) -> bool:
        return not self.seqs and not self.starved

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """Each sequence with its share (built on demand: the step loop reads the works)."""
        return [
            ScheduledSeq(seq, len(w.token_ids), w.sampling is not None)
            for seq, w in zip(self.seqs, self.works, strict=True)
        ]
