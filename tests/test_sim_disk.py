"""The simulated disk tier: reads and writes take their time, keys only, LRU when full."""

from __future__ import annotations

import pytest

from kvpilot.engine.clock import VirtualClock
from kvpilot.errors import ConfigError
from kvpilot.sim.disk import SimulatedDiskStore


def disk(clock: VirtualClock, slots: int = 4) -> SimulatedDiskStore:
    return SimulatedDiskStore(
        clock, num_slots=slots, block_bytes=1000, read_bytes_per_s=1e6, write_bytes_per_s=5e5
    )


def test_writes_and_reads_take_bytes_over_bandwidth_one_after_another() -> None:
    clock = VirtualClock()
    store = disk(clock)
    first = store.put_many([(b"a", b""), (b"b", b"")])
    second = store.put_many([(b"c", b"")])
    assert first.finish_s == pytest.approx(0.004)  # 2000 bytes at 0.5 MB/s
    assert second.finish_s == pytest.approx(0.006)  # queued behind the first
    assert not first.done()
    assert first.result() == [True, True]
    assert clock.now() == pytest.approx(0.004)
    read = store.get_async([b"a", b"b"])
    assert read.finish_s == pytest.approx(0.006)  # 2000 bytes at 1 MB/s from 0.004
    assert read.result() == [b"", b""]
    assert store.stats.read_bw_bytes_s == 1e6 and store.stats.blocks_written == 3


def test_a_read_of_a_block_still_being_written_waits_for_the_write() -> None:
    clock = VirtualClock()
    store = disk(clock)
    store.put_many([(b"a", b"")])  # done at 0.002
    read = store.get_async([b"a"])
    assert read.finish_s == pytest.approx(0.003)  # starts when the write is done


def test_a_missing_block_reads_as_none_and_a_full_store_evicts_the_least_recent() -> None:
    clock = VirtualClock()
    store = disk(clock, slots=2)
    store.put_many([(b"a", b""), (b"b", b"")]).result()
    assert store.get_many([b"a"]) == [b""]  # a is now more recent than b
    store.put_many([(b"c", b"")]).result()
    assert b"b" not in store and store.contains(b"a") and store.contains(b"c")
    assert store.get_many([b"b", b"c"]) == [None, b""]
    assert store.stats.evictions == 1 and store.stats.misses == 1
    assert store.delete(b"a") and not store.delete(b"a")
    assert len(store) == 1
    store.check_invariants()


def test_a_disk_needs_slots_and_bandwidth() -> None:
    with pytest.raises(ConfigError, match="positive"):
        SimulatedDiskStore(
            VirtualClock(), num_slots=1, block_bytes=1, read_bytes_per_s=0, write_bytes_per_s=1
        )


def test_the_simulated_engine_pauses_to_disk_and_reloads_from_it() -> None:
    import dataclasses

    from kvpilot.engine.sampling import SamplingParams
    from kvpilot.sim.build import SimSetup, build_engine

    setup = SimSetup(model="llama-3-70b", node="8xh100", tp=8, kv_blocks=256)
    per_block = 16 * setup.geometry().bytes_per_token(8)
    setup = dataclasses.replace(
        setup, host_kv_bytes_per_device=64 * per_block, disk_kv_bytes_per_device=512 * per_block
    )
    engine, _ = build_engine(setup, 32000, "offload-disk")
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    session = engine.open_session()
    session.generate(list(range(1000, 1800)), params)
    session.pause(expected_wait_s=60.0)
    while engine.offload.busy():
        engine.step()
    moved = engine.offload.stats.bytes_moved
    assert moved["device_to_disk"] == 50 * per_block  # 800 tokens: 50 full blocks
    # 50 blocks over one device's share of the node's 7 GB/s NVMe
    assert engine.offload.mover.disk_bw() == pytest.approx(7e9 / 8)
    engine.clock.advance(60.0)  # type: ignore[attr-defined]
    out = session.generate([5, 6, 7], params)
    assert out.cached_tokens >= 800 - 16
    assert engine.offload.stats.bytes_moved["disk_to_device"] == 50 * per_block
    assert engine.offload.stats.recomputed_tokens < 16  # only the partial last block
    engine.close()
