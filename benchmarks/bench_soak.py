"""Soak: concurrent agent sessions against a real `kvpilot serve` for minutes, with faults.

N agent sessions (client-chosen ids) run completion turns back to back over loopback HTTP,
each ending on a tool call (so the session pauses, offloaded to disk), while a chaos thread
injects faults: bad requests (lone surrogates, broken JSON, out-of-range numbers), clients
that disconnect mid-request, a corrupt block in the disk tier, a full disk (a small tmpfs
filled up, where root can mount one; otherwise skipped and said so), and a ~4 MB prompt.
A streaming client measures the longest gap between its chunks meanwhile. The server is
killed with SIGKILL and restarted on the same disk folder every phase; after each restart
every session must still exist with at least the tokens its client last saw.

Outputs are checked against a recompute: a sample of turns is re-run as a plain request of
the same prompt tokens under a fresh cache salt (nothing cached), greedy, on the
context-sensitive `tiny` model; any differing token is a wrong output.

Usage: python benchmarks/bench_soak.py [--duration 180] [--sessions 6] [--restarts 2]
The last line printed is one JSON object:
{"requests", "errors_5xx", "sessions_lost", "wrong_outputs", "max_stall_ms",
 "restarts_survived"}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvpilot.server.process import ServeProcess

MAX_SESSION_TOKENS = 1400  # past this a session is closed and a new one started
TOOLS = ("ls", "pytest", "grep", "cat", "git diff")


@dataclass
class Tally:
    requests: int = 0
    errors_5xx: int = 0
    conn_errors: int = 0  # requests cut by a kill -9 (expected)
    statuses: Counter[int] = field(default_factory=Counter)
    checked: int = 0
    wrong_outputs: int = 0
    sessions_lost: int = 0
    restarts_survived: int = 0
    max_stall_s: float = 0.0
    faults: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def saw(self, response: httpx.Response) -> None:
        with self.lock:
            self.requests += 1
            self.statuses[response.status_code] += 1
            if response.status_code >= 500:
                self.errors_5xx += 1
                print(f"  5xx: {response.status_code} {response.text[:200]}")


class Agent:
    """One session: a client-chosen id and the tokens its client has seen."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.generation = 0
        self.tokens = 0
        self.rng = random.Random(index)

    @property
    def session_id(self) -> str:
        return f"agent-{self.index}.{self.generation}"

    def turn(self, http: httpx.Client, tally: Tally, verify: bool) -> None:
        if self.tokens > MAX_SESSION_TOKENS:
            tally.saw(http.delete(f"/v1/sessions/{self.session_id}"))
            self.generation += 1
            self.tokens = 0
        step = self.rng.randrange(1000)
        body = {
            "prompt": f"\nstep {step}: ran {self.rng.choice(TOOLS)}, output {secrets.token_hex(6)}",
            "max_tokens": 8,
            "temperature": 0.0,
            "session_id": self.session_id,
            "expected_tool_wait_s": self.rng.choice((0.5, 5.0, 60.0)),
            "tool": self.rng.choice(TOOLS),
            "return_token_ids": verify,
        }
        response = http.post("/v1/completions", json=body)
        tally.saw(response)
        if response.status_code != 200:
            return
        data = response.json()
        usage = data["usage"]
        self.tokens = usage["prompt_tokens"] + usage["completion_tokens"]
        if verify:
            check(http, data["kvpilot"], tally)


def check(http: httpx.Client, info: dict[str, Any], tally: Tally) -> None:
    """Re-run the turn's whole prompt with nothing cached; the tokens must be the same."""
    prompt, got = info["prompt_token_ids"], info["completion_token_ids"][0]
    body = {
        "prompt": prompt,
        "max_tokens": len(got),
        "temperature": 0.0,
        "cache_salt": secrets.token_hex(8),
        "return_token_ids": True,
    }
    response = http.post("/v1/completions", json=body)
    tally.saw(response)
    if response.status_code != 200:
        return
    want = response.json()["kvpilot"]["completion_token_ids"][0]
    with tally.lock:
        tally.checked += 1
        if want[: len(got)] != got:
            tally.wrong_outputs += 1
            print(f"  wrong output: {got} != recompute {want}")


def streamer(url: str, stop: threading.Event, tally: Tally) -> None:
    """Streams one long request after another; the longest gap between chunks (after the
    first) is the longest stall any stream saw."""
    body = {"prompt": "stream on", "max_tokens": 200, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                last = None
                for _ in r.iter_lines():
                    now = time.monotonic()
                    if last is not None:
                        with tally.lock:
                            tally.max_stall_s = max(tally.max_stall_s, now - last)
                    last = now
                    if stop.is_set():
                        break
        except httpx.HTTPError:
            time.sleep(0.2)


def chaos(url: str, disk: Path, stop: threading.Event, tally: Tally, kinds: list[str]) -> None:
    rng = random.Random(7)
    http = httpx.Client(base_url=url, timeout=120)
    bad = [
        b'{"prompt": "a \\ud800 b", "max_tokens": 2}',
        b'{"prompt": "x", "max_tokens": 2',
        b'{"prompt": "x", "expected_tool_wait_s": 1e300, "session_id": "chaos"}',
        b'{"prompt": "x", "temperature": 1e400}',
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
    ]
    while not stop.wait(rng.uniform(0.5, 2.0)):
        kind = rng.choice(kinds)
        tally.faults[kind] += 1
        try:
            if kind == "bad":
                path = "/v1/chat/completions" if b"messages" in (b := rng.choice(bad)) else None
                response = http.post(
                    path or "/v1/completions",
                    content=b,
                    headers={"Content-Type": "application/json"},
                )
                tally.saw(response)
            elif kind == "disconnect":
                body = {"prompt": "long one", "max_tokens": 400, "ignore_eos": True}
                with contextlib.suppress(httpx.TimeoutException):
                    httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)
            elif kind == "corrupt":
                corrupt_a_block(disk / "blocks.dat", rng)
            elif kind == "big":
                tally.saw(http.post("/v1/completions", json={"prompt": "y" * 3_900_000}))
            elif kind == "full":
                fill_disk(disk, seconds=3.0, stop=stop)
        except httpx.TransportError:
            pass  # the server is being killed
    http.close()


def corrupt_a_block(path: Path, rng: random.Random) -> None:
    try:
        size = path.stat().st_size
        with path.open("r+b") as f:
            f.seek(rng.randrange(max(size - 64, 1)))
            f.write(os.urandom(64))
    except OSError:
        pass


def fill_disk(disk: Path, seconds: float, stop: threading.Event) -> None:
    """Fill the (small tmpfs) file system holding the disk tier, hold it full, free it."""
    filler = disk / "filler"
    try:
        with filler.open("wb") as f:
            while True:
                f.write(b"\0" * (1 << 16))
    except OSError:
        pass
    stop.wait(seconds)
    filler.unlink(missing_ok=True)


def mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def sessions_survived(url: str, agents: list[Agent], tally: Tally) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        for agent in agents:
            if not agent.tokens:
                continue
            response = http.get(f"/v1/sessions/{agent.session_id}")
            tally.saw(response)
            if response.status_code != 200 or response.json()["tokens"] < agent.tokens:
                tally.sessions_lost += 1
                print(f"  lost {agent.session_id}: {response.status_code} {response.text[:120]}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="kvpilot-soak-"))
    disk = root / "disk"
    disk.mkdir()
    kinds = [k for k in args.faults.split(",") if k]
    full_disk = "full" in kinds and mount_tmpfs(disk, "24m")
    if not full_disk and "full" in kinds:
        kinds.remove("full")
    serve_args = ["--kv-blocks", "192", "--disk-dir", str(disk), "--disk-blocks", "256"]
    serve_args += ["--policy", "breakeven", "--poison-freed-blocks", "--max-body-bytes"]
    serve_args += [str(8 << 20), "--shutdown-timeout", "5"]
    agents = [Agent(i) for i in range(args.sessions)]
    tally = Tally()
    phase_s = args.duration / (args.restarts + 1)
    started = time.monotonic()
    try:
        for phase in range(args.restarts + 1):
            with ServeProcess(serve_args) as server:
                if phase:
                    sessions_survived(server.base_url, agents, tally)
                    tally.restarts_survived += 1
                stop = threading.Event()
                threads = [
                    threading.Thread(target=streamer, args=(server.base_url, stop, tally)),
                    threading.Thread(
                        target=chaos, args=(server.base_url, disk, stop, tally, kinds)
                    ),
                ]

                def agent_loop(
                    agent: Agent, url: str = server.base_url, stop: threading.Event = stop
                ) -> None:
                    with httpx.Client(base_url=url, timeout=120) as http:
                        n = 0
                        while not stop.is_set():
                            try:
                                agent.turn(http, tally, verify=n % 4 == 0)
                            except httpx.TransportError:
                                with tally.lock:
                                    tally.conn_errors += 1
                                time.sleep(0.2)
                            n += 1

                threads += [threading.Thread(target=agent_loop, args=(a,)) for a in agents]
                for t in threads:
                    t.start()
                time.sleep(phase_s)
                if phase < args.restarts:
                    assert server._proc is not None
                    server._proc.kill()  # SIGKILL, mid-traffic
                    server._proc.wait(30)
                stop.set()
                for t in threads:
                    t.join(120)
                print(f"phase {phase + 1}: {tally.requests} requests so far")
    finally:
        if full_disk:
            subprocess.run(["umount", str(disk)], check=False)
        shutil.rmtree(root, ignore_errors=True)
    wall = time.monotonic() - started
    print()
    print(f"{'requests':<26}{tally.requests}")
    print(f"{'by status':<26}{dict(sorted(tally.statuses.items()))}")
    print(f"{'5xx':<26}{tally.errors_5xx}")
    print(f"{'cut by kill -9':<26}{tally.conn_errors}")
    print(f"{'outputs checked':<26}{tally.checked} (wrong: {tally.wrong_outputs})")
    print(f"{'sessions lost':<26}{tally.sessions_lost}")
    print(f"{'restarts survived':<26}{tally.restarts_survived}")
    print(f"{'longest stream stall':<26}{tally.max_stall_s * 1e3:.0f} ms")
    print(f"{'faults injected':<26}{dict(tally.faults)}")
    print(f"{'full disk':<26}{'tmpfs of 24 MiB' if full_disk else 'skipped (no tmpfs)'}")
    print(f"{'wall':<26}{wall:.0f} s")
    return {
        "requests": tally.requests,
        "errors_5xx": tally.errors_5xx,
        "sessions_lost": tally.sessions_lost,
        "wrong_outputs": tally.wrong_outputs,
        "max_stall_ms": round(tally.max_stall_s * 1e3, 1),
        "restarts_survived": tally.restarts_survived,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=180.0, help="seconds in all")
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--restarts", type=int, default=2, help="kill -9 + restart count")
    parser.add_argument(
        "--faults",
        default="bad,disconnect,corrupt,big,full",
        help="faults the chaos thread picks from (comma-separated)",
    )
    print(json.dumps(run(parser.parse_args())))


if __name__ == "__main__":
    main()
