"""Real crashes: a serving process is killed with SIGKILL mid disk write, mid offload and mid
session save; a new engine on the same disk folder resumes the session, and its next turn
equals an uncrashed recompute (tokens and logits), with the KV that survived read from disk.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.engine import Engine

from equivalence import (
    FIRST,
    PARAMS,
    SECOND,
    THIRD,
    LogitRecorder,
    assert_same_turns,
    reference_turns,
)
from kill import sigkill_when_ready

CHILD = Path(__file__).with_name("crash_child.py")


def run_and_kill(cache_dir: Path, disk: Path, point: str) -> list[list[int]]:
    """The child's two turns' outputs; it is SIGKILLed at ``point`` of its second pause."""
    lines = sigkill_when_ready([str(CHILD), str(cache_dir), str(disk), point])
    return json.loads(next(line for line in lines if line.startswith("[")))


@pytest.mark.parametrize(
    ("point", "saved_turns"),
    [("disk-write", 2), ("offload", 2), ("session-save", 1)],
)
def test_a_session_resumes_after_sigkill_as_if_nothing_happened(
    point: str, saved_turns: int, tiny_model_dir: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    outputs = run_and_kill(tiny_model_dir.parent, disk, point)
    want = reference_turns(tiny_model_dir, [FIRST, SECOND, THIRD])
    assert outputs == [list(t.tokens) for t in want[:2]]

    engine = Engine.from_pretrained(
        "tiny",
        cache_dir=tiny_model_dir.parent,
        kv_blocks=128,
        disk_dir=str(disk),
        pause_policy="offload-disk",
    )
    assert engine.offload.disk is not None
    engine.offload.disk.check_invariants()
    session = engine.open_session(session_id="agent-1")
    # The session is whatever its last durable save said: both turns, or (killed inside the
    # second save) the first; the client sends the turn that followed it.
    history = [*FIRST, *outputs[0], *SECOND, *outputs[1]]
    saved = history[: len(FIRST) + len(outputs[0])] if saved_turns == 1 else history
    assert session.tokens == saved
    recorder = LogitRecorder(engine)
    rid = session.submit(THIRD if saved_turns == 2 else SECOND, PARAMS)
    request = engine.requests[rid]
    turn = recorder.finish(rid)
    assert_same_turns([turn], [want[saved_turns]])
    # What survived on disk was used: at least the first pause's full blocks.
    assert request.cached_by_tier["disk"] >= (len(FIRST) + len(outputs[0]) - 1) // 16 * 16
    engine.offload.disk.check_invariants()
    engine.close()
