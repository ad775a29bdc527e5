"""Several conversations in one session: which one each request continues, and its reuse.

A session id (or a ``prompt_cache_key``) is meant to name one trajectory, but harnesses
share one between an orchestrator and its sub-agents, or a user simulator and the agent.
Compared only with the request just before it, every switch looks like a break at the
head. The `BreakDetector` keeps the last prompt of each conversation it has seen (the most
recent few), so a request that extends an earlier conversation is recognised as a return
to it, not as a break of that conversation, and reuse is counted per conversation:

    requests:       A1  B1  A2  B2  A3        (A, B: two conversations, one session)
    vs previous:    -   X   X   X   X         (every request breaks the one before)
    per conversation: A1 -> A2 -> A3 appends; B1 -> B2 appends; the switches are
                    "interleaved_conversation", and no conversation ever broke its prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvpilot.promptcache.breaks import (
    BreakCause,
    PrefixBreak,
    PromptView,
    classify_break,
    common_prefix_len,
)

MAX_CONVERSATIONS = 8  # conversations remembered per group (least recently used dropped)
RETURN_FRACTION = 0.5  # a request continues a conversation if it shares this much of it


@dataclass(slots=True)
class Conversation:
    number: int  # 0, 1, ... in order of appearance within the group
    last: PromptView
    requests: int = 1
    prompt_tokens: int = 0
    reused_tokens: int = 0  # block-aligned common prefix with the conversation's last prompt

    @property
    def reuse_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class Observation:
    """What one request was, seen from its group."""

    conversation: int
    reused_tokens: int  # what a cache holding the conversation's last prompt would serve
    prefix_break: PrefixBreak | None  # vs the previous request of the group
    switched: bool  # continues a different conversation than the previous request

    @property
    def breaks_conversation(self) -> bool:
        """A break the conversation itself caused (not a switch between conversations)."""
        b = self.prefix_break
        return b is not None and b.cause is not BreakCause.INTERLEAVED


class BreakDetector:
    """Prefix breaks and per-conversation reuse of one session or cache-key group."""

    def __init__(self, block_size: int = 16, max_conversations: int = MAX_CONVERSATIONS) -> None:
        self.block_size = block_size
        self.max_conversations = max_conversations
        self.conversations: list[Conversation] = []  # remembered, most recently used last
        self.retired: list[Conversation] = []  # forgotten ones (their counters only)
        self._next = 0
        self._current: Conversation | None = None

    def observe(self, view: PromptView) -> Observation:
        current = self._current
        if current is None:
            return self._start(view, None)
        brk = classify_break(current.last, view)
        if brk is None:
            return self._continue(current, view, None, switched=False)
        other = self._best_other(view, current)
        if other is not None:
            switch = replace(
                brk,
                cause=BreakCause.INTERLEAVED,
                detail=f"returns to conversation {other.number} of this session",
            )
            return self._continue(other, view, switch, switched=True)
        if brk.cause is BreakCause.INTERLEAVED:
            return self._start(view, brk)
        return self._continue(current, view, brk, switched=False)

    def _best_other(self, view: PromptView, current: Conversation) -> Conversation | None:
        own = common_prefix_len(current.last.tokens, view.tokens)
        best, best_k = None, own
        for conv in self.conversations:
            if conv is current:
                continue
            k = common_prefix_len(conv.last.tokens, view.tokens)
            if k > best_k and k >= RETURN_FRACTION * len(conv.last.tokens):
                best, best_k = conv, k
        return best

    def _reuse(self, last: Sequence[int], tokens: Sequence[int]) -> int:
        k = common_prefix_len(last, tokens)
        usable = max(0, len(tokens) - 1)  # the last prompt token is always computed
        return min(k, usable) // self.block_size * self.block_size

    def _continue(
        self, conv: Conversation, view: PromptView, brk: PrefixBreak | None, *, switched: bool
    ) -> Observation:
        reused = self._reuse(conv.last.tokens, view.tokens)
        conv.last = view
        conv.requests += 1
        conv.prompt_tokens += len(view.tokens)
        conv.reused_tokens += reused
        self._touch(conv)
        return Observation(conv.number, reused, brk, switched)

    def _start(self, view: PromptView, brk: PrefixBreak | None) -> Observation:
        conv = Conversation(self._next, view, prompt_tokens=len(view.tokens))
        self._next += 1
        self.conversations.append(conv)
        if len(self.conversations) > self.max_conversations:
            old = self.conversations.pop(0)
            old.last = PromptView(())
            self.retired.append(old)
        self._current = conv
        return Observation(conv.number, 0, brk, switched=brk is not None)

    def _touch(self, conv: Conversation) -> None:
        self.conversations.remove(conv)
        self.conversations.append(conv)
        self._current = conv

    @property
    def num_conversations(self) -> int:
        return self._next

    def all_conversations(self) -> list[Conversation]:
        """Every conversation seen, in order of appearance."""
        return sorted([*self.retired, *self.conversations], key=lambda c: c.number)
