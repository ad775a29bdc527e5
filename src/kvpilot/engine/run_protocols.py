"""What a uniform decode run (`kvpilot.engine.decode_run`) needs of the executor and offers a
caller that looks inside it: the simulator's runner implements `DecodeRunExecutor`, its event
loop `RunLookout`."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from kvpilot.engine.request import Sequence as Seq


class TokenStream(NamedTuple):
    """The tokens a sequence samples at generation steps ``first``, ``first + 1``, ...,
    as int32 ids (kept as an array: no object per token until a run takes its slice)."""

    first: int
    ids: array


class DecodeRunExecutor(Protocol):
    """An executor that can account many decode-only steps at once (the simulator's)."""

    def decode_run_clock(
        self,
        positions: Sequence[int],
        start: float,
        until: float,
        max_steps: int,
        running: Sequence[Seq],
    ) -> tuple[list[float], list[float]]:
        """Seconds of each successive step decoding sequences at ``positions`` (their start
        positions at the first step), exactly as `execute` would take, from clock time
        ``start``: up to ``max_steps`` steps or to the first that ends at or after ``until``.
        And their start times, each the previous one plus its step's duration, as a clock
        advanced step by step adds them, followed by the last step's end. ``running``: the
        sequences at ``positions`` (whose block tables `execute` would read)."""
        ...

    def decode_run_stream(
        self, seed: int, first_step: int, steps: int, ahead: int = 0
    ) -> TokenStream:
        """The tokens `execute` samples for a sequence of ``seed`` at generation steps
        ``first_step`` onwards, at least ``steps`` of them, in a stream that may start earlier
        and run further; ``ahead``: how many later runs may ask for (a hint)."""
        ...

    def record_decode_run(
        self, running: Sequence[Seq], positions: Sequence[int], durations: Sequence[float]
    ) -> None:
        """Count the steps of the ``running`` sequences at ``positions`` as executed (the
        caller moves the clock)."""
        ...


class RunLookout(Protocol):
    """Something that looks at the engine at step boundaries inside a run (the simulator's
    telemetry samples), so that a run need not stop for it. At those boundaries the clock,
    the block pools, the prefix cache's evictable blocks, the batch and the inter-token
    latencies recorded (`EngineStats.itl_s`) are what stepping one by one would leave, and
    so are sequences' computed counts (set to the look's step, `Trajectory.computed_in_run`);
    their tokens are not (appended in bulk)."""

    def plan_looks(self, starts: Sequence[float]) -> tuple[list[int], int]:
        """For a run whose step ``j`` starts at clock time ``starts[j]`` (the last entry: when
        the run would end), the boundaries ``0 < j < steps`` to look at, increasing, and the
        number of steps the run may take (fewer when the caller must act at a boundary)."""
        ...

    def look(self) -> None:
        """Look at the engine at the next boundary planned (the clock shows its time)."""
        ...
