"""The simulated host tier: copies take their time on the link, one queue per direction."""

from __future__ import annotations

import pytest

from kvpilot.engine.clock import VirtualClock
from kvpilot.errors import ConfigError
from kvpilot.sim.transport import SimulatedTransport


def transport(clock: VirtualClock) -> SimulatedTransport:
    return SimulatedTransport(clock, num_host_blocks=64, block_bytes=1000, link_bytes_per_s=1e6)


def test_a_copy_takes_bytes_over_bandwidth_and_completes_in_the_background() -> None:
    clock = VirtualClock()
    t = transport(clock).swap_out([(0, 0), (1, 1)])
    assert not t.done()
    clock.advance(0.0019)
    assert not t.done()
    clock.advance(0.0001)
    assert t.done()
    assert t.result() == pytest.approx(0.002)
    assert clock.now() == pytest.approx(0.002)


def test_waiting_on_an_unfinished_copy_advances_the_clock() -> None:
    clock = VirtualClock()
    t = transport(clock).swap_in([(0, 0)] * 5)
    assert t.result() == pytest.approx(0.005)
    assert clock.now() == pytest.approx(0.005)


def test_copies_queue_per_direction_but_not_across_directions() -> None:
    clock = VirtualClock()
    link = transport(clock)
    first = link.swap_out([(0, 0)] * 3)
    second = link.swap_out([(0, 0)] * 3)
    back = link.swap_in([(0, 0)] * 3)
    assert first.finish_s == pytest.approx(0.003)
    assert second.finish_s == pytest.approx(0.006)
    assert back.finish_s == pytest.approx(0.003)
    assert second.result() == pytest.approx(0.003)
    assert link.bytes_out == 6000 and link.bytes_in == 3000


def test_disk_moves_cross_the_same_link_with_a_stand_in_per_block() -> None:
    clock = VirtualClock()
    link = transport(clock)
    out = link.read_device([0, 1])
    assert out.finish_s == pytest.approx(0.002)
    assert out.result() == [b"", b""]
    back = link.write_device([0], [b""])
    assert back.finish_s == pytest.approx(0.003)  # the in queue was free: starts at 0.002
    assert link.bytes_out == 2000 and link.bytes_in == 1000


def test_a_link_needs_a_positive_bandwidth() -> None:
    with pytest.raises(ConfigError, match="positive link"):
        SimulatedTransport(VirtualClock(), num_host_blocks=1, block_bytes=1, link_bytes_per_s=0)
