"""How a request on a session becomes the session's next turn.

Tokens are the truth: a session's trajectory holds every token so far (prompts and
generated output). A request's prompt is turned into the *whole* conversation's tokens P
and compared with the session's tokens S:

- S is a proper prefix of P: the turn is the suffix P[len(S):]; all of S's KV is reused.
- otherwise P and S part at k = their common prefix length (a client edited history, or
  the reply it resends does not re-tokenize to the tokens generated). The trajectory
  restarts from P; the radix cache still serves the full blocks of P[:k], so reuse is
  "up to the first differing token", block-aligned. k is reported to the client.

How P is formed depends on whether the client resends the history or only the new part
(``session_history``): "full" means the request holds the whole conversation, "append"
means it holds only what follows the session's history. "auto" decides per request:
a chat request is "full" when it contains an assistant message (a resent history always
holds the previous replies; an appended user or tool message does not); a completion
prompt is "full" when it starts with the prompt that opened the session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.promptcache.breaks import common_prefix_len
from kvpilot.server.protocol import SessionHistory

__all__ = [
    "TurnPlan",
    "chat_resends_history",
    "common_prefix_len",
    "completion_resends_history",
    "plan_turn",
]


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """What to submit for a turn: ``tokens`` after the history, or a restart with them."""

    tokens: list[int]
    restart: bool
    divergence_index: int | None


def plan_turn(history: Sequence[int], prompt: Sequence[int]) -> TurnPlan:
    """The turn that takes a session holding ``history`` to the whole prompt ``prompt``."""
    if not history:
        return TurnPlan(list(prompt), restart=False, divergence_index=None)
    k = common_prefix_len(history, prompt)
    if k == len(history) and len(prompt) > k:
        return TurnPlan(list(prompt[k:]), restart=False, divergence_index=None)
    return TurnPlan(list(prompt), restart=True, divergence_index=k)


def chat_resends_history(mode: SessionHistory, messages: Sequence[dict[str, Any]]) -> bool:
    if mode != "auto":
        return mode == "full"
    return any(m.get("role") == "assistant" for m in messages)


def completion_resends_history(
    mode: SessionHistory, prompt: Sequence[int], opening: Sequence[int]
) -> bool:
    if mode != "auto":
        return mode == "full"
    return (
        bool(opening)
        and len(prompt) >= len(opening)
        and list(prompt[: len(opening)]) == list(opening)
    )
