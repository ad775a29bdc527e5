"""What each agent session is doing now: running, waiting, paused or idle.

- running: a turn is being computed (its sequence is in the scheduler's running batch);
- waiting: a turn was submitted and waits for admission (or for its KV to come back);
- paused: the session is off at a tool, with a standing pause decision;
- idle: open, nothing submitted, not paused.

Both functions read engine state, so they run on the engine thread.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpilot.engine import Engine

SESSION_STATES = ("running", "waiting", "paused", "idle")


def _scheduled(engine: Engine) -> tuple[set[str], set[str]]:
    scheduler = engine.scheduler
    running = {s.request.session_id for s in scheduler.running if s.request.session_id}
    waiting = {s.request.session_id for s in scheduler.waiting if s.request.session_id}
    return running, waiting - running


def session_state_counts(engine: Engine) -> dict[str, int]:
    """Sessions per state; costs the running and waiting queues and the pauses, not every
    open session (the metrics snapshot calls it after every engine iteration)."""
    running, waiting = _scheduled(engine)
    # A pause record lasts until the session's next turn is submitted or it closes.
    paused = len(engine.offload.records)
    counts = {"running": len(running), "waiting": len(waiting), "paused": paused}
    counts["idle"] = max(0, len(engine.sessions) - sum(counts.values()))
    return counts


def session_states(engine: Engine, session_ids: Iterable[str]) -> dict[str, str]:
    """The state of each of these sessions that is still open."""
    running, waiting = _scheduled(engine)
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
