"""Agent sessions: one trajectory kept across turns, forkable copy-on-write."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from kvpilot.engine.request import RequestOutput
from kvpilot.engine.sampling import SamplingParams
from kvpilot.errors import InvalidRequest

if TYPE_CHECKING:
    from kvpilot.engine.engine import Engine
    from kvpilot.engine.tier_stats import PauseRecord
    from kvpilot.memory import Trajectory
    from kvpilot.policy.breakeven import PauseDecision


class Session:
    """An agent trajectory that lives across turns.

    Each turn appends its prompt to the trajectory's tokens and reuses the KV of
    everything before it; the turn's output becomes history too. ``fork(n)`` makes ``n``
    sessions that share every full block and copy at most one partial block each.
    """

    def __init__(self, engine: Engine, session_id: str, traj: Trajectory, salt: str | None) -> None:
        self.engine = engine
        self.session_id = session_id
        self.traj = traj
        self.salt = salt
        self.active_request: str | None = None
        self.closed = False
        self.turns = 0
        self.last_used = engine.clock.now()
        self.last_output: RequestOutput | None = None

    @property
    def tokens(self) -> list[int]:
        return list(self.traj.tokens)

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
        return self.engine.add_request(
            prompt, params, session=self, expected_tool_wait_s=expected_tool_wait_s, tool=tool
        )

    def pause(self, expected_wait_s: float | None = None, tool: str | None = None) -> PauseDecision:
        """The agent is off to a tool: retain, offload or drop this session's KV (the policy
        decides; with no ``expected_wait_s`` the wait is predicted from past waits)."""
        return self.engine.pause_session(self, expected_wait_s, tool)

    @property
    def last_pause(self) -> PauseRecord | None:
        return self.engine.offload.record_for(self.session_id)

    def generate(
        self, prompt: str | Seq[int], params: SamplingParams | None = None
    ) -> RequestOutput:
        """Run one turn to completion and return its output."""
        request_id = self.submit(prompt, params)
        return self.engine.run_until_finished(request_id)

    def rewind(self, num_tokens: int) -> None:
        """Cut the history back to its first ``num_tokens`` tokens (for a client that resends a
        history differing from what the session holds). Full blocks before the cut stay cached.
        """
        self._check_open()
        if self.active_request is not None:
            raise InvalidRequest("cannot rewind a session while a turn is running")
        self.traj.truncate(num_tokens)
        high = self.engine.offload.high_water
        tid = self.traj.traj_id
        if high.get(tid, 0) > num_tokens:
            high[tid] = num_tokens  # what follows the cut is new, not recomputed

    def fork(self, n: int = 1) -> list[Session]:
        """``n`` new sessions continuing from this one's state, sharing its KV."""
        return self.engine.fork_session(self, n)

    def close(self) -> None:
        self.engine.close_session(self)

    def _check_open(self) -> None:
        if self.closed:
            raise InvalidRequest(f"session {self.session_id} is closed")
