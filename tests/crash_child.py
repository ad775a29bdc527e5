"""A serving process that the crash tests kill with SIGKILL at a chosen point.

Usage: crash_child.py MODEL_CACHE_DIR DISK_DIR POINT

Session "agent-1" runs FIRST, pauses to disk (durable), runs SECOND, then pauses again; POINT
chooses where that second pause is caught, still running, when this process prints
``READY`` and waits to be killed:

- ``disk-write``: the disk writer has written the first block of the batch to the data file
  (no fsync, no index row yet);
- ``offload``: the offload's device -> bytes copy is in flight on the copier thread (the
  session is saved);
- ``session-save``: inside the SQL statement that saves the session's tokens.

Before that it prints one JSON line: the tokens its two turns generated.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvpilot.engine import Engine
from kvpilot.model.transfer import TorchTierTransport
from kvpilot.store.slot_file import SlotFile

from equivalence import FIRST, PARAMS, SECOND, settle
from kill import ready_then_wait

POINTS = ("disk-write", "offload", "session-save")


def crash_in_disk_write() -> None:
    write = SlotFile.write

    def first_block_then_crash(
        self: SlotFile, writes: Sequence[tuple[int, bytes]], **kw: Any
    ) -> None:
        write(self, list(writes)[:1], fsync=False)
        ready_then_wait()

    SlotFile.write = first_block_then_crash  # type: ignore[method-assign]


def crash_in_offload(paused: threading.Event) -> None:
    def copy_then_crash(self: TorchTierTransport, blocks: Sequence[int]) -> Future[list[bytes]]:
        def wait_for_the_pause() -> list[bytes]:
            paused.wait()  # the session is saved: the crash comes mid-copy, after it
            ready_then_wait()
            return []

        return self._copier.submit(wait_for_the_pause)

    TorchTierTransport.read_device = copy_then_crash  # type: ignore[method-assign]


def crash_in_session_save(engine: Engine) -> None:
    store = engine.offload.session_store
    assert store is not None

    def in_the_statement() -> int:
        ready_then_wait()
        return 0

    store._conn.set_progress_handler(in_the_statement, 1)


def main(cache_dir: str, disk: str, point: str) -> None:
    if point not in POINTS:
        raise SystemExit(f"unknown crash point {point!r}; one of {POINTS}")
    engine = Engine.from_pretrained(
        "tiny",
        cache_dir=Path(cache_dir),
        kv_blocks=128,
        disk_dir=disk,
        pause_policy="offload-disk",
        poison_freed_blocks=True,
    )
    session = engine.open_session(session_id="agent-1")
    outputs = [list(session.generate(FIRST, PARAMS).token_ids)]
    session.pause(expected_wait_s=600.0, tool="pytest")
    settle(engine)
    assert engine.offload.disk is not None
    engine.offload.disk.flush()
    outputs.append(list(session.generate(SECOND, PARAMS).token_ids))
    print(json.dumps(outputs), flush=True)
    paused = threading.Event()
    if point == "disk-write":
        crash_in_disk_write()
    elif point == "offload":
        crash_in_offload(paused)
    else:
        crash_in_session_save(engine)
    session.pause(expected_wait_s=600.0, tool="pytest")
    paused.set()
    settle(engine)
    engine.offload.disk.flush()
    raise SystemExit(f"crash point {point} was never reached")


if __name__ == "__main__":
    main(*sys.argv[1:4])
