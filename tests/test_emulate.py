"""Emulated links: targets from the presets, copies that finish at the target's speed."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from kvpilot.emulate.disk import ThrottledDiskStore
from kvpilot.emulate.link import LinkSchedule, ThrottledTransfer
from kvpilot.emulate.target import EMULATION_TARGETS, emulation_target
from kvpilot.emulate.transport import ThrottledTransport
from kvpilot.errors import ConfigError
from kvpilot.store import DiskBlockStore


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def done(value: Any) -> Future[Any]:
    f: Future[Any] = Future()
    f.set_result(value)
    return f


def test_h100_target_is_the_napkin_ratio() -> None:
    # Napkin Math 0.6: 21 ms to reload a 32k-token llama-3-70b context, 1.3 s to recompute.
    t = emulation_target("h100-pcie5")
    assert t.link_ratio == pytest.approx(62, abs=1)
    assert t.disk_ratio < 1  # one NVMe drive for 8 GPUs is slower than recomputing
    assert t.link_bytes_per_s(4096, 1000) == pytest.approx(t.link_ratio * 4096 * 1000)
    ratios = {name: emulation_target(name).link_ratio for name in EMULATION_TARGETS}
    assert ratios["gb200"] > ratios["h100-pcie5"] > ratios["b200"]  # C2C; B200's FLOPs


def test_unknown_target_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="h100-pcie5"):
        emulation_target("tpu")


def test_copies_queue_per_direction_at_the_link_bandwidth() -> None:
    clock = FakeClock()
    link = LinkSchedule(1000.0, clock)
    assert link.reserve("out", 500) == (100.0, 100.5)
    assert link.reserve("out", 1000) == (100.5, 101.5)  # behind the first
    assert link.reserve("in", 1000) == (100.0, 101.0)  # the other direction is free
    clock.t = 200.0
    assert link.reserve("out", 100) == (200.0, 200.1)
    with pytest.raises(ConfigError):
        LinkSchedule(0.0)


def test_a_transfer_is_done_only_when_its_slot_ends() -> None:
    clock = FakeClock()
    heard: list[float] = []
    t = ThrottledTransfer(done(0.001), 100.0, 101.0, clock, timed=True, on_settle=heard.append)
    assert not t.done()
    clock.t = 101.5
    assert t.done() and heard == [1.0]  # the slot, not when it was polled
    assert t.result() == 1.0  # the emulated seconds, not the real copy's 1 ms
    assert heard == [1.0]  # heard once


def test_a_real_copy_slower_than_the_slot_is_waited_for() -> None:
    clock = FakeClock()
    inner: Future[Any] = Future()
    heard: list[float] = []
    t = ThrottledTransfer(inner, 100.0, 100.5, clock, timed=False, on_settle=heard.append)
    clock.t = 101.0
    assert not t.done()
    inner.set_result(["bytes"])
    clock.t = 102.0
    assert t.done() and t.result() == ["bytes"]
    assert heard == [1.0]  # the real copy ended at 101


class RecordingTransport:
    num_host_blocks = 4
    block_bytes = 100

    def __init__(self) -> None:
        self.calls: list[str] = []

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> Future[Any]:
        self.calls.append("swap_out")
        return done(0.0)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> Future[Any]:
        self.calls.append("swap_in")
        return done(0.0)

    def read_device(self, blocks: Sequence[int]) -> Future[Any]:
        self.calls.append("read_device")
        return done([b"x" * 100] * len(blocks))

    def write_device(self, blocks: Sequence[int], data: Sequence[bytes]) -> Future[Any]:
        self.calls.append("write_device")
        return done(0.0)

    def poison_host(self, blocks: Sequence[int]) -> None:
        self.calls.append("poison_host")


def test_transport_copies_run_at_the_emulated_speed() -> None:
    clock = FakeClock()
    inner = RecordingTransport()
    t = ThrottledTransport(inner, LinkSchedule(1000.0, clock))
    out = t.swap_out([(0, 0), (1, 1)])  # 200 bytes: 0.2 s
    back = t.swap_in([(0, 0)])  # 100 bytes the other way: 0.1 s
    read = t.read_device([2])  # queued behind the swap out: done at 0.3 s
    assert not (out.done() or back.done() or read.done())
    clock.t = 100.25
    assert out.done() and back.done() and not read.done()
    assert out.result() == pytest.approx(0.2)
    clock.t = 100.3
    assert read.done() and read.result() == [b"x" * 100]
    t.poison_host([1])
    assert inner.calls == ["swap_out", "swap_in", "read_device", "poison_host"]
    assert t.num_host_blocks == 4 and t.block_bytes == 100


def test_disk_store_reads_and_writes_at_the_emulated_speed(tmp_path: Path) -> None:
    clock = FakeClock()
    inner = DiskBlockStore(tmp_path, 8, 64, fsync=False)
    disk = ThrottledDiskStore(inner, LinkSchedule(640.0, clock))  # 10 blocks/s
    key = b"k" * 16
    put = disk.put_many([(key, b"\1" * 64)])
    inner.flush()  # the real write is done at 100.0
    assert not put.done()
    clock.t = 100.2
    assert put.result() == [True]
    assert disk.contains(key) and key in disk and len(disk) == 1  # passed through
    got = disk.get_async([key])
    assert not got.done()
    clock.t = 100.3
    assert got.result() == [b"\1" * 64]
    assert disk.stats.read_bw_bytes_s == pytest.approx(640.0)
    assert disk.stats.write_bw_bytes_s == pytest.approx(640.0)  # the slot, not the poll
    disk.close()
