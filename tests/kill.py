"""Real crashes for tests: run a child until it says ``READY``, then SIGKILL it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

READY = "READY"


def sigkill_when_ready(args: Sequence[str], timeout_s: float = 240.0) -> list[str]:
    """Run ``python *args``; when it prints a line ``READY`` (and then waits), kill it with
    SIGKILL. Returns the lines it printed before. Fails if it exits or times out first."""
    child = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert child.stdout is not None and child.stderr is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + timeout_s
        for line in child.stdout:
            if line.strip() == READY:
                break
            lines.append(line.rstrip("\n"))
            assert time.monotonic() < deadline, "the child never got ready to be killed"
        else:
            raise AssertionError(f"the child exited before it was killed:\n{child.stderr.read()}")
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()
    return lines


def ready_then_wait() -> None:
    """In the child: report the crash point, then wait for the parent's SIGKILL."""
    print(READY, flush=True)
    while True:
        time.sleep(60)
