"""Prompts become tokens off the engine thread, and too-long prompts never reach it.

Tokenising is the one per-request cost that grows with the prompt and needs no engine state,
so it runs on a small worker pool: a multi-megabyte prompt delays its own answer, not every
other stream. Before any tokenising, a prompt whose UTF-8 size alone proves it cannot fit
the context (no token decodes to more than `max_token_bytes` bytes) is refused at once.

What runs here only reads the engine's constants (its tokenizer, vocabulary size, context
and pool sizes), never its mutable state. The tokenizer is shared with the engine thread,
which decodes outputs: both only read it (special-token splitting, which would change its
state, goes through `chat_render`'s own plain-text encoder).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvpilot.engine import Engine
from kvpilot.errors import PromptTooLong
from kvpilot.server.chat_render import ChatRenderer

T = TypeVar("T")

TOKENIZER_THREADS = 2


class Tokenization:
    """The worker pool, and the cheap length check that runs before it."""

    def __init__(self, engine: Engine, threads: int = TOKENIZER_THREADS) -> None:
        self.engine = engine
        self.renderer = ChatRenderer(engine.tokenizer) if engine.tokenizer is not None else None
        self.max_model_len = engine.max_model_len
        self.max_token_bytes = _max_token_bytes(engine.tokenizer)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvpilot-tokenize")

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def check_size(self, *parts: Any) -> None:
        """PromptTooLong when the text in ``parts`` (strings, messages, tools) is too large to
        fit the context whatever it tokenises to."""
        nbytes = sum(_text_bytes(p) for p in parts)
        at_least = nbytes // self.max_token_bytes
        if at_least >= self.max_model_len:
            raise PromptTooLong(
                f"a prompt of {nbytes:,} bytes is at least {at_least:,} tokens, over the model "
                f"context of {self.max_model_len} tokens: shorten the prompt"
            )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _text_bytes(part: Any) -> int:
    if part is None:
        return 0
    if isinstance(part, str):
        return len(part.encode("utf-8", "surrogatepass"))
    if isinstance(part, list) and all(isinstance(t, int) for t in part):
        return 0  # token ids are counted exactly later, for free
    if isinstance(part, list | tuple):
        return sum(_text_bytes(p) for p in part)
    if isinstance(part, dict):
        return sum(_text_bytes(v) for v in part.values())
    return len(json.dumps(part, default=str))


def _max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the bytes one token decodes to: 4 per character of the longest
    vocabulary entry (byte-level entries hold one byte per character; SentencePiece pieces
    at most one UTF-8 character per character)."""
    if tokenizer is None:
        return 1 << 30  # token ids only: nothing to bound
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return 1 << 30
    longest = max((len(t) for t in vocab), default=1)
    return 4 * max(longest, 1)
