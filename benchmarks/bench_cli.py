"""The first hour's waits: CLI start-up, and how long `kvpilot demo` leaves a person waiting.

1. Start-up of `kvpilot --help`, `kvpilot plan` and `import kvpilot.cli` in fresh
   processes: median wall seconds and CPU seconds (user + sys) over a few runs. CPU time
   is the figure to compare on a shared machine.
2. With ``--demo``: the whole `kvpilot demo` (or `make demo` with ``--make``) run on a
   pseudo-terminal, as a person at a terminal sees it: time to its first output, the longest
   silence (no byte written, spinners count) and the longest wait between two new lines of
   text, and the total.

Usage: python benchmarks/bench_cli.py [--runs N] [--demo] [--make]
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import resource
import select
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KVPILOT = [sys.executable, "-m", "kvpilot.cli"]
STARTUP = {
    "kvpilot --help": [*KVPILOT, "--help"],
    "kvpilot plan": [*KVPILOT, "plan"],
    "import kvpilot.cli": [sys.executable, "-c", "import kvpilot.cli"],
}


@dataclass(frozen=True, slots=True)
class Timing:
    wall_s: float
    cpu_s: float


def run_once(argv: list[str]) -> Timing:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timing(wall, cpu)


def startup(runs: int) -> dict[str, float]:
    print(f"{'command':<22} {'wall (s, median)':>17} {'cpu (s, median)':>16}   (runs: {runs})")
    figures: dict[str, float] = {}
    for label, argv in STARTUP.items():
        run_once(argv)  # warm the page cache and bytecode
        timings = [run_once(argv) for _ in range(runs)]
        wall = statistics.median(t.wall_s for t in timings)
        cpu = statistics.median(t.cpu_s for t in timings)
        print(f"{label:<22} {wall:>17.3f} {cpu:>16.3f}")
        key = label.replace("kvpilot ", "").replace("--", "").replace(" ", "_").replace(".", "_")
        figures[f"{key}_wall_s"] = round(wall, 3)
        figures[f"{key}_cpu_s"] = round(cpu, 3)
    return figures


def watch_on_pty(argv: list[str]) -> dict[str, float]:
    """Run ``argv`` on a pseudo-terminal; time its first output, silences and total."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: becomes the command, its output goes to the terminal
        os.chdir(ROOT)
        os.environ.setdefault("COLUMNS", "100")
        os.execvp(argv[0], argv)
    start = time.monotonic()
    last_byte = last_line = start
    first = None
    longest_silence = longest_line_wait = silence_at = 0.0
    while True:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        now = time.monotonic()
        first = first if first is not None else now - start
        if now - last_byte > longest_silence:
            longest_silence, silence_at = now - last_byte, last_byte - start
        last_byte = now
        if b"\n" in data:
            longest_line_wait = max(longest_line_wait, now - last_line)
            last_line = now
    _, status = os.waitpid(pid, 0)
    total = time.monotonic() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed with status {status}")
    return {
        "first_output_s": round(first or total, 2),
        "longest_silence_s": round(longest_silence, 2),
        "longest_silence_after_s": round(silence_at, 1),
        "longest_wait_for_a_line_s": round(longest_line_wait, 2),
        "total_s": round(total, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="start-up runs per command")
    parser.add_argument("--demo", action="store_true", help="also time `kvpilot demo`")
    parser.add_argument("--make", action="store_true", help="time `make demo` instead")
    args = parser.parse_args()
    figures = startup(args.runs)
    if args.demo or args.make:
        label = "make demo" if args.make else "kvpilot demo"
        argv = ["make", "demo"] if args.make else [*KVPILOT, "demo"]
        demo = watch_on_pty(argv)
        print(f"\n{label} on a terminal:")
        for key, value in demo.items():
            print(f"  {key:<28} {value:>8}")
        figures.update({f"demo_{k}": v for k, v in demo.items()})
    sys.stdout.flush()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
