"""What each agent session is doing now: running, waiting, paused or idle.

- running: a turn is being computed (its sequence is in the scheduler's running batch);
- waiting: a turn was submitted and waits for admission (or for its KV to come back);
- paused: the session is off at a tool, with a standing pause decision;
- idle: open, nothing submitted, not paused.

Both read engine state, so they run on the engine thread.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpilot.engine import Engine
from kvpilot.engine.snapshot import SESSION_STATES, scheduled_sessions
from kvpilot.engine.snapshot import session_state_counts as _counts

__all__ = ["SESSION_STATES", "session_state_counts", "session_states"]


def session_state_counts(engine: Engine) -> dict[str, int]:
    """Sessions per state (the engine snapshot carries the same counts)."""
    return _counts(engine.scheduler, engine.offload, len(engine.sessions))


def session_states(engine: Engine, session_ids: Iterable[str]) -> dict[str, str]:
    """The state of each of these sessions that is still open."""
    running, waiting = scheduled_sessions(engine.scheduler)
    states: dict[str, str] = {}
    for sid in session_ids:
        session = engine.sessions.get(sid)
        if session is None:
            continue
        if sid in running:
            states[sid] = "running"
        elif sid in waiting or session.active_request is not None:
            states[sid] = "waiting"
        elif engine.offload.record_for(sid) is not None:
            states[sid] = "paused"
        else:
            states[sid] = "idle"
    return states
