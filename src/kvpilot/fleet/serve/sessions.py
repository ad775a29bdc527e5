"""The ingress's record of each agent session: where it runs, and enough to rebuild it.

A session lives on one replica (its engine holds the tokens and KV). The ingress keeps the
conversation as the client sees it (chat messages, or the text of a completions session),
so that when the session's replica dies, or the router moves the session off an
overloaded one, the next turn re-creates it on another replica and resends the whole
history (``session_history: "full"``): nothing the client sent is lost, only KV, which
the new replica recomputes or finds in its own cache.

Public ids are the ids clients know (the first replica's); ``local_id`` is the id on the
replica that holds the session now.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class FrontSession:
    session_id: str
    tenant: str | None
    cache_salt: str | None
    replica: str
    local_id: str
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat, as of the last turn
    text: str = ""  # a completions session's prompt + completion text so far
    resendable: bool = True  # False once a turn's history could not be mirrored
    moves: int = 0
    resend: bool = False  # the next turn resends the whole conversation (it just moved)
    lost: bool = False  # its replica restarted (a new epoch): the engine session is gone

    def conversation(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The whole conversation of a chat turn (history + what this request sends)."""
        messages = list(body.get("messages") or [])
        mode = body.get("session_history", "auto")
        resends = mode == "full" or (
            mode == "auto" and any(m.get("role") == "assistant" for m in messages)
        )
        return messages if resends or not self.messages else self.messages + messages

    def completion_text(self, body: dict[str, Any]) -> str | None:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return None
        mode = body.get("session_history", "auto")
        if mode == "full" or (mode == "auto" and self.text and prompt.startswith(self.text)):
            return prompt
        return self.text + prompt

    def record_chat(self, conversation: list[dict[str, Any]], reply: str) -> None:
        self.messages = [*conversation, {"role": "assistant", "content": reply}]

    def record_completion(self, whole_prompt: str | None, completion: str) -> None:
        if whole_prompt is None:
            self.resendable = False
            return
        self.text = whole_prompt + completion


class FrontSessions:
    def __init__(self) -> None:
        self._sessions: dict[str, FrontSession] = {}

    def add(self, session: FrontSession) -> None:
        self._sessions[session.session_id] = session

    def get(self, session_id: str, tenant: str | None) -> FrontSession | None:
        session = self._sessions.get(session_id)
        if session is None or session.tenant != tenant:
            return None
        return session

    def remove(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def on_replica(self, replica: str) -> list[FrontSession]:
        return [s for s in self._sessions.values() if s.replica == replica]

    def __len__(self) -> int:
        return len(self._sessions)
