"""Chat prompts without role injection: message content never becomes control tokens.

A chat template joins messages with control text (``<|end|>``, ``<|system|>``, ...) that the
tokenizer maps to special tokens. Tokenising the rendered prompt as a whole would map the
same text inside a message to the same special tokens, so a user could end their turn and
forge a system turn. Here the template's own text is tokenised with special tokens parsed,
and each message's content with special-token parsing off (``split_special_tokens``, as
`transformers` calls it): inside content, ``<|system|>`` is just its characters.

Only contents that hold some special token's text need this (others tokenise the same either
way): each is replaced by a marker for the template, and the marker's place in the rendered
text is where the content's own tokens go.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from typing import Any

from kvpilot.errors import InvalidRequest


def special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The text of every special token the tokenizer parses."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {t.content for t in added.values() if getattr(t, "special", False) and t.content}
    texts |= {t for t in getattr(tokenizer, "all_special_tokens", ()) if t}
    return tuple(sorted(texts))


class ChatRenderer:
    """Renders chat prompts with one tokenizer; safe to use from several threads at once.

    Content is encoded by a private copy of the tokenizer's backend that never parses
    special tokens: toggling `split_special_tokens` on the shared tokenizer would change its
    state under the other threads' feet.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.specials = special_texts(tokenizer)
        self._plain = _plain_encoder(tokenizer)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        generation_prompt: bool,
    ) -> tuple[str, list[int]]:
        """The rendered prompt's text and its tokens, content tokenised as plain text."""
        marked: list[dict[str, Any]] = []
        contents: dict[str, str] = {}
        for message in messages:
            content = message.get("content")
            if isinstance(content, str) and any(s in content for s in self.specials):
                marker = f"kvpilot{secrets.token_hex(8)}"
                contents[marker] = content
                message = {**message, "content": marker}
            marked.append(message)
        text = _apply(self.tokenizer, marked, tools, generation_prompt)
        if not contents:
            return text, self.encode(text)
        tokens: list[int] = []
        plain: list[str] = []
        rest = text
        while True:
            found = [(rest.find(m), m) for m in contents if m in rest]
            if not found:
                break
            at, marker = min(found)
            tokens += self.encode(rest[:at])
            tokens += self._plain(contents[marker])
            plain += [rest[:at], contents[marker]]
            rest = rest[at + len(marker) :]
        tokens += self.encode(rest)
        plain.append(rest)
        return "".join(plain), tokens

    def encode(self, text: str) -> list[int]:
        """Template text: special tokens parsed."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []


def _apply(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    generation_prompt: bool,
) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )
    except Exception as exc:  # jinja2 raises TemplateError, templates raise what they like
        raise InvalidRequest(f"the chat template refused these messages: {exc}") from exc


def _plain_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """Text -> tokens with no special-token parsing, by a private copy of a fast tokenizer's
    backend (a slow tokenizer is asked per call, under a lock)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        from tokenizers import Tokenizer

        plain = Tokenizer.from_str(backend.to_str())
        plain.encode_special_tokens = True
        plain.no_truncation()
        plain.no_padding()

        def encode_fast(text: str) -> list[int]:
            if not text:
                return []
            return list(plain.encode_batch([text], add_special_tokens=False)[0].ids)

        return encode_fast
    lock = threading.Lock()

    def encode_slow(text: str) -> list[int]:
        if not text:
            return []
        with lock:
            return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    return encode_slow
