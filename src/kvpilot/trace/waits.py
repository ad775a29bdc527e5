"""Pause waits from agent traces: each call's own recorded gap, the tool it ran, and a tail of
human approvals on one time factor.

The wait after call i is the trace's gap from call i to call i+1 (generation plus tool time,
`TraceSession.gaps_s`), as recorded (real seconds), under the name of the tool the call ran:
the first program of the reply's ```bash block (``cd DIR &&`` skipped), else ``"tool"``.
With probability ``approval_probability`` per pause, the agent also waits for a person to
approve the command first: a log-uniform draw between ``approval_min_s`` and
``approval_max_s`` (a minute to an hour by default), multiplied by ``time_factor``, is added
and the pause is named ``"approval"``, as an agent framework knows when it asks a person.
The factor is the one compression: a benchmark cannot wait hours, so it scales the human
tail (0.01 turns an hour into 36 s) and leaves the tools' own gaps at their recorded length.
Draws are seeded per (session, call), so every policy of a comparison sees the same waits.
"""

from __future__ import annotations

import math
import random
import re
import zlib
from dataclasses import dataclass

from kvpilot.errors import ConfigError
from kvpilot.trace.loader import TraceSession

APPROVAL_TOOL = "approval"
DEFAULT_TOOL = "tool"
_BASH = re.compile(r"```(?:bash|sh)\s*\n(.*?)(?:```|$)", re.DOTALL)
_SKIP = re.compile(r"^\s*(?:cd\s+\S+\s*&&\s*)+")


def tool_of(output: str) -> str:
    """The program a reply runs: the first word of its ```bash block, after ``cd X &&``."""
    match = _BASH.search(output)
    if match is None:
        return DEFAULT_TOOL
    command = _SKIP.sub("", match.group(1).strip())
    words = command.split()
    if not words:
        return DEFAULT_TOOL
    return words[0].rsplit("/", 1)[-1][:32] or DEFAULT_TOOL


@dataclass(frozen=True, slots=True)
class PauseWait:
    wait_s: float
    tool: str


@dataclass(frozen=True, slots=True)
class WaitModel:
    time_factor: float = 1.0  # applies to approvals only
    approval_probability: float = 0.05
    approval_min_s: float = 60.0
    approval_max_s: float = 3600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.time_factor > 0:
            raise ConfigError(f"the wait time factor must be positive, got {self.time_factor}")
        if not 0.0 <= self.approval_probability <= 1.0:
            raise ConfigError("approval_probability must be in [0, 1]")
        if not 0 < self.approval_min_s <= self.approval_max_s:
            raise ConfigError("approval waits need 0 < approval_min_s <= approval_max_s")

    def approval_s(self, rng: random.Random) -> float:
        lo, hi = math.log(self.approval_min_s), math.log(self.approval_max_s)
        return math.exp(rng.uniform(lo, hi))

    def waits(self, session: TraceSession) -> list[PauseWait]:
        """The pause after each call but the last: its recorded gap, plus any approval."""
        out = []
        for i, (call, gap) in enumerate(zip(session.calls, session.gaps_s, strict=False)):
            key = f"{self.seed}:{session.session_id}:{i}".encode()
            rng = random.Random(zlib.crc32(key))
            wait, tool = max(gap, 0.0), tool_of(call.output)
            if rng.random() < self.approval_probability:
                wait, tool = wait + self.approval_s(rng) * self.time_factor, APPROVAL_TOOL
            out.append(PauseWait(wait, tool))
        return out

    def describe(self) -> str:
        return (
            f"the trace's gaps per tool as recorded, plus approvals on "
            f"{self.approval_probability:.0%} of pauses (log-uniform {self.approval_min_s:g}-"
            f"{self.approval_max_s:g} s, x {self.time_factor:g})"
        )
