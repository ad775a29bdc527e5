"""Agent sessions and the table of open sessions.

A `Session` is one trajectory kept across turns, forkable copy-on-write. The `SessionTable`
is the one registry of open sessions: it opens (or restores from the session store), finds,
forks, pauses, rewinds and closes them, and tracks each one's turn. It is handed its
collaborators (the KV manager, the offload manager, the executor, the clock, the counters
and a `TurnRunner` that queues turns) and never imports the engine.

Ids are the caller's or the table's (``sess-N``); a session restored after a restart keeps
its id. Every session records when it was last used, for idle reclaim (and expiry).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol

from kvpilot.engine.branches import copy_forked_tails
from kvpilot.engine.reclaim import reclaim
from kvpilot.engine.request import Request, RequestOutput
from kvpilot.engine.sampling import SamplingParams
from kvpilot.engine.stats import EngineStats
from kvpilot.errors import InvalidRequest, SessionBusy, SessionNotFound, require
from kvpilot.memory import ForkResult, KVManager, Trajectory

if TYPE_CHECKING:
    from kvpilot.engine.executor import Executor
    from kvpilot.engine.offload import OffloadManager
    from kvpilot.engine.tier_stats import PauseRecord
    from kvpilot.policy.breakeven import PauseDecision


class TurnRunner(Protocol):
    """How the table queues a session's turn and waits for it (the engine is one)."""

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        session: Session | None = None,
        salt: str | None = None,
        expected_tool_wait_s: float | None = None,
        tool: str | None = None,
    ) -> str: ...

    def run_until_finished(self, request_id: str) -> RequestOutput: ...

    def abort(self, request_id: str) -> None: ...


class Session:
    """An agent trajectory that lives across turns.

    Each turn appends its prompt to the trajectory's tokens and reuses the KV of
    everything before it; the turn's output becomes history too. ``fork(n)`` makes ``n``
    sessions that share every full block and copy at most one partial block each.
    """

    def __init__(
        self, table: SessionTable, session_id: str, traj: Trajectory, salt: str | None
    ) -> None:
        self._table = table
        self.session_id = session_id
        self.traj = traj
        self.salt = salt
        self.active_request: str | None = None
        self.closed = False
        self.turns = 0
        self.last_used = table.now()

    @property
    def tokens(self) -> list[int]:
        """The session's tokens as a new list of ints (the trajectory holds them as int32)."""
        return self.traj.tokens.tolist()

    @property
    def num_tokens(self) -> int:
        return len(self.traj.tokens)

    @property
    def idle(self) -> bool:
        return self.active_request is None and not self.closed

    def submit(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        *,
        expected_tool_wait_s: float | None = None,
        tool: str | None = None,
    ) -> str:
        """Start a turn; returns its request id (the engine's step loop runs it).

        With ``expected_tool_wait_s`` or ``tool``, the session pauses when the turn ends.
        """
        return self._table.runner.add_request(
            prompt, params, session=self, expected_tool_wait_s=expected_tool_wait_s, tool=tool
        )

    def pause(self, expected_wait_s: float | None = None, tool: str | None = None) -> PauseDecision:
        """The agent is off to a tool: retain, offload or drop this session's KV (the policy
        decides; with no ``expected_wait_s`` the wait is predicted from past waits)."""
        return self._table.pause(self, expected_wait_s, tool)

    @property
    def last_pause(self) -> PauseRecord | None:
        return self._table.offload.record_for(self.session_id)

    def generate(
        self, prompt: str | Seq[int], params: SamplingParams | None = None
    ) -> RequestOutput:
        """Run one turn to completion and return its output."""
        request_id = self.submit(prompt, params)
        return self._table.runner.run_until_finished(request_id)

    def rewind(self, num_tokens: int) -> None:
        """Cut the history back to its first ``num_tokens`` tokens (for a client that resends a
        history differing from what the session holds). Full blocks before the cut stay cached.
        """
        self._table.rewind(self, num_tokens)

    def fork(self, n: int = 1) -> list[Session]:
        """``n`` new sessions continuing from this one's state, sharing its KV."""
        return self._table.fork(self, n)

    def close(self) -> None:
        self._table.close(self)


class SessionTable(Mapping[str, Session]):
    """The open sessions by id (a read-only mapping), and every change to them."""

    def __init__(
        self,
        kv: KVManager,
        offload: OffloadManager,
        executor: Executor,
        clock: Callable[[], float],
        stats: EngineStats,
        runner: TurnRunner,
    ) -> None:
        self.kv = kv
        self.offload = offload
        self.executor = executor
        self.now = clock
        self.stats = stats
        self.runner = runner
        self._sessions: dict[str, Session] = {}
        self._ids = itertools.count()

    # -- the mapping ------------------------------------------------------------------

    def __getitem__(self, session_id: str) -> Session:
        return self._sessions[session_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sessions)

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str, default: Session | None = None) -> Session | None:  # type: ignore[override]
        """The open session ``session_id``, else ``default`` (the dict's own lookup: the
        step loop asks once per finished turn, `Mapping.get` would make two calls of it)."""
        return self._sessions.get(session_id, default)

    def require(self, session_id: str) -> Session:
        """The open session ``session_id``; SessionNotFound if there is none."""
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"unknown session {session_id!r}")
        return session

    def idle(self) -> list[Session]:
        """Sessions between turns that hold device KV."""
        return [s for s in self._sessions.values() if s.idle and s.traj.block_table]

    # -- opening and closing ----------------------------------------------------------

    def open(self, salt: str | None = None, session_id: str | None = None) -> Session:
        sid = session_id or f"sess-{next(self._ids)}"
        if sid in self._sessions:
            raise InvalidRequest(f"session id {sid!r} is already in use")
        stored = self.offload.stored_session(sid)
        if stored is not None:
            # A session paused before a restart: its tokens come back from SQLite, its KV
            # from the disk tier (whatever is still there and verifies) on the next turn.
            traj = self.kv.open_trajectory(salt=stored.salt, tokens=stored.tokens)
            self.offload.restored(traj)
            salt = stored.salt
        else:
            traj = self.kv.open_trajectory(salt=salt)
        return self._add(Session(self, sid, traj, salt))

    def _add(self, session: Session) -> Session:
        self._sessions[session.session_id] = session
        self.offload.session_idle(session)
        return session

    def fork(self, session: Session, n: int = 1) -> list[Session]:
        self._check_idle(session, "fork")
        if n < 1:
            raise InvalidRequest("fork needs n >= 1")
        forks: list[Session] = []
        results: list[ForkResult] = []
        for _ in range(n):
            result = self.kv.fork_or_defer(session.traj)
            results.append(result)
            sid = f"{session.session_id}.{next(self._ids)}"
            child = self._add(Session(self, sid, result.child, session.salt))
            child.turns = session.turns
            forks.append(child)
        copy_forked_tails(self.executor, results, self.stats)
        self.stats.forks += n
        return forks

    def close(self, session: Session) -> None:
        if session.closed:
            return
        if session.active_request is not None:
            self.runner.abort(session.active_request)
        self.offload.forget(session)
        session.traj.close()
        session.closed = True
        self._sessions.pop(session.session_id, None)

    # -- between turns ----------------------------------------------------------------

    def pause(
        self, session: Session, expected_wait_s: float | None = None, tool: str | None = None
    ) -> PauseDecision:
        """The agent went off to a tool: decide what to do with this session's KV."""
        self._check_idle(session, "pause")
        return self.offload.pause(session, expected_wait_s, tool)

    def rewind(self, session: Session, num_tokens: int) -> None:
        self._check_idle(session, "rewind")
        session.traj.truncate(num_tokens)
        self.offload.rewound(session.traj, num_tokens)

    def reclaim_idle(self, blocks_wanted: int) -> int:
        """Memory pressure: idle sessions' KV gives way (demoted by the offload manager)."""
        del blocks_wanted  # one session at a time; the scheduler asks again if short
        return reclaim(self.offload, self.idle())

    # -- turns ------------------------------------------------------------------------

    def check_turn(self, session: Session, params: SamplingParams) -> None:
        """May ``session`` start a turn with ``params``? (Nothing changes if not.)"""
        if session.closed:  # `_check_open`'s test, without its call (once per turn)
            self._check_open(session)
        if session.active_request is not None:
            raise SessionBusy(
                f"session {session.session_id} is running turn {session.active_request}"
            )
        if params.n != 1:
            raise InvalidRequest("n > 1 is not allowed on a session turn: fork the session")

    def begin_turn(
        self, session: Session, request: Request, tokens: Seq[int], ids: array | None = None
    ) -> Trajectory:
        """The turn's request is valid: resume a paused session, append the prompt (int32
        ids as `RequestLimits.prompt_ids` gives them; ``ids``: see `append_tokens`)."""
        if self.offload.record_for(session.session_id) is not None:
            request.resumed = True
            self.offload.on_resume(session)
        session.traj.append_tokens(tokens, ids)
        session.active_request = request.request_id
        self.offload.session_busy(session)
        session.turns += 1
        return session.traj

    def end_turn(self, request: Request) -> None:
        """A session's turn finished: the session is idle again, paused if the turn said so."""
        session = self._sessions.get(request.session_id or "")
        if session is None:
            return
        session.active_request = None
        session.last_used = self.now()
        self.offload.session_idle(session)
        if request.pause_hint is not None and not request.aborted:
            # Open (in the table) and idle (just now): what `pause` would check first.
            self.offload.pause(session, *request.pause_hint)

    def _check_open(self, session: Session) -> None:
        if session.closed:
            raise SessionNotFound(f"session {session.session_id} is closed")

    def _check_idle(self, session: Session, action: str) -> None:
        self._check_open(session)
        if session.active_request is not None:
            raise SessionBusy(
                f"cannot {action} session {session.session_id} while it is running turn "
                f"{session.active_request}: wait for the turn to finish"
            )

    # -- checks -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        for sid, session in self._sessions.items():
            require(session.session_id == sid, f"session {session.session_id} filed as {sid}")
            require(not session.closed, f"closed session {sid} is still in the table")
            traj = session.traj
            require(not traj.closed, f"session {sid} holds a closed trajectory")
            require(
                (sid in self.offload.idle_held) == (session.active_request is None),
                f"session {sid}: the offload manager's idle sessions disagree with its turn",
            )
            require(
                self.kv.trajectories.get(traj.traj_id) is traj,
                f"session {sid}'s trajectory is not registered with the KV manager",
            )
