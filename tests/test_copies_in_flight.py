"""A sequence alone in the pool waits for blocks that tier copies in flight still pin.

Found by bench_pause's CPU run: a paused session's state was being copied to host (its
device blocks pinned until the copy finishes) when another session's 2k-token turn, admitted
with its first prefill chunk, could not get blocks for the next one. Being alone in the
pool, it was ended as "starved", with no output at all, although the copy was about to
free the blocks it needed.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvpilot.engine.engine import Engine
from kvpilot.engine.sampling import SamplingParams

from equivalence import FIRST, PARAMS, tiered

# 200 tokens in chunks of 64: the first chunk fits beside the pinned blocks, the rest not.
LONG = [(13 * i + 5) % 240 + 5 for i in range(200)]
LONG_PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def gate_swap_outs(engine: Engine) -> threading.Event:
    """Device -> host copies finish only once the returned event is set."""
    transport: Any = engine.offload.mover.transport
    swap_out, gate = transport.swap_out, threading.Event()

    def held(pairs: Any) -> Future[Any]:
        inner, outer = swap_out(pairs), Future()

        def finish() -> None:
            gate.wait()
            outer.set_result(inner.result())

        threading.Thread(target=finish, daemon=True).start()
        return outer

    transport.swap_out = held
    return gate


def alone(tmp_path: Path) -> list[int]:
    engine = tiered("tiny", tmp_path / "alone", "retain", kv_blocks=16, max_prefill_chunk=64)
    (out,) = engine.generate([LONG], LONG_PARAMS)
    engine.close()
    return list(out.token_ids)


def test_a_lone_sequence_waits_for_blocks_that_copies_in_flight_pin(tmp_path: Path) -> None:
    engine = tiered("tiny", tmp_path, "offload-host", kv_blocks=16, max_prefill_chunk=64)
    gate = gate_swap_outs(engine)
    paused = engine.open_session()
    paused.generate(FIRST, PARAMS)  # 158 tokens: 10 of the 16 blocks
    paused.pause(expected_wait_s=30.0)  # offload to host: its blocks stay pinned meanwhile
    assert engine.offload.busy()
    rid = engine.add_request(LONG, LONG_PARAMS)
    for _ in range(20):
        engine.step()
        engine.check_invariants()
    out = engine.get_output(rid)
    assert not out.finished, "ended while the copy that frees its blocks was in flight"
    gate.set()
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    out = engine.get_output(rid)
    assert out.outputs[0].finish_reason == "length"
    assert list(out.token_ids) == alone(tmp_path)
    engine.close()


def test_an_idle_step_on_virtual_time_gives_a_real_copy_real_time(tmp_path: Path) -> None:
    """On a virtual clock, an idle step waits (up to a moment) for a copy a thread runs
    before the clock moves on: otherwise the clock can race past a pause's timers while the
    copy is still in flight (a CI failure: a prefetch fired before the disk write ended)."""
    engine = tiered("tiny", tmp_path, "offload-host")
    gate = gate_swap_outs(engine)
    session = engine.open_session()
    session.generate(FIRST, PARAMS)
    start = engine.clock.now()
    session.pause(expected_wait_s=30.0)
    (copy,) = engine.offload.mover.in_flight()
    threading.Timer(0.01, gate.set).start()  # the copy takes 10 ms of real time from here
    engine.step()  # nothing to run: an idle step
    assert copy.done(), "the idle step did not wait for the copy"
    assert engine.clock.now() - start < 0.01
    engine.close()
