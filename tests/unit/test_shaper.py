"""The link shaper: FIFO bandwidth and latency per ordered DC pair."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from expertmesh.planner import Topology
from expertmesh.workers.shaper import LinkDown, LinkShaper


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def _shaper(clock: FakeClock, enabled: bool = True) -> LinkShaper:
    topo = Topology.generate(2, 1).with_inter_dc(0.08, 20.0)  # 10 MB/s, 20 ms
    return LinkShaper.from_topology(topo, enabled=enabled, clock=clock)


def test_messages_queue_on_a_link_and_arrive_after_latency() -> None:
    clock = FakeClock()
    s = _shaper(clock)
    assert s.reserve(0, 1, 1_000_000) == pytest.approx(100.0 + 0.1 + 0.02)
    assert s.reserve(0, 1, 1_000_000) == pytest.approx(100.0 + 0.2 + 0.02)  # queued behind
    assert s.reserve(1, 0, 1_000_000) == pytest.approx(100.0 + 0.1 + 0.02)  # other direction
    assert s.reserve(0, 0, 10**9) == 100.0  # inside a DC: not shaped
    assert s.bytes[0, 1] == 2_000_000 and s.bytes[1, 0] == 1_000_000


def test_send_sleeps_the_sender_and_off_only_counts() -> None:
    clock = FakeClock()
    s = _shaper(clock)
    assert s.send(0, 1, 500_000, sleep=clock.sleep) == pytest.approx(0.07)
    off = _shaper(clock, enabled=False)
    assert off.send(0, 1, 10**9, sleep=clock.sleep) == 0.0
    assert off.bytes[0, 1] == 10**9


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        LinkShaper(np.ones((2, 3)), np.ones((2, 3)))
    with pytest.raises(ValueError):
        LinkShaper(np.zeros((2, 2)), np.zeros((2, 2)))
    with pytest.raises(ValueError):
        _shaper(FakeClock()).reserve(0, 5, 1)


def test_concurrent_senders_share_the_link_at_its_bandwidth() -> None:
    """Four threads book 64 KB messages on one 40 Mbit/s pair at the same (fake) instant: the
    link serializes them back to back, so the last arrives after exactly total bytes /
    bandwidth + latency, every message has its own 12.8 ms slot, and no byte is lost."""
    clock = FakeClock()
    topo = Topology.generate(2, 1).with_inter_dc(0.04, 5.0)  # 5 MB/s, 5 ms
    s = LinkShaper.from_topology(topo, clock=clock)
    msg, per_thread = 64_000, 8
    arrivals: list[float] = []
    lock = threading.Lock()

    def sender() -> None:
        for _ in range(per_thread):
            t = s.reserve(0, 1, msg)
            with lock:
                arrivals.append(t)

    threads = [threading.Thread(target=sender) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    n = 4 * per_thread
    assert int(s.bytes[0, 1]) == n * msg and int(s.messages[0, 1]) == n
    arrivals.sort()
    slot = msg / 5e6
    np.testing.assert_allclose(np.diff(arrivals), slot, rtol=1e-9)
    assert arrivals[0] == pytest.approx(100.0 + slot + 0.005)
    assert arrivals[-1] == pytest.approx(100.0 + n * msg / 5e6 + 0.005)


def test_a_lone_sender_waits_out_each_message() -> None:
    """One sender that sleeps until each message arrives (fake clock and sleep): the link idles
    during the latency, so n messages take n * (size / bandwidth + latency)."""
    clock = FakeClock()
    topo = Topology.generate(2, 1).with_inter_dc(0.04, 5.0)
    s = LinkShaper.from_topology(topo, clock=clock)
    slept = [s.send(0, 1, 64_000, sleep=clock.sleep) for _ in range(10)]
    assert slept == pytest.approx([64_000 / 5e6 + 0.005] * 10)
    assert clock.now == pytest.approx(100.0 + 10 * (64_000 / 5e6 + 0.005))


def test_shaper_instances_on_one_file_share_the_links(tmp_path) -> None:
    """Two shapers on one path (as two worker processes map it) queue on the same buckets."""
    clock = FakeClock()
    topo = Topology.generate(2, 1).with_inter_dc(0.08, 20.0)  # 10 MB/s, 20 ms
    path = str(tmp_path / "links")
    a = LinkShaper.from_topology(topo, clock=clock, path=path)
    b = LinkShaper.from_topology(topo, clock=clock, path=path)
    assert a.reserve(0, 1, 1_000_000) == pytest.approx(100.12)
    assert b.reserve(0, 1, 1_000_000) == pytest.approx(100.22)  # behind a's message
    assert b.reserve(1, 0, 500_000) == pytest.approx(100.07)
    assert a.totals().tolist() == [[0, 2_000_000], [500_000, 0]]
    assert a.messages[0, 1] == 2
    b.reset()
    assert a.totals().sum() == 0 and a.reserve(0, 1, 0) == pytest.approx(100.02)
    a.close()
    b.close()


def test_shared_shaper_counts_every_byte_under_concurrent_senders(tmp_path) -> None:
    topo = Topology.generate(2, 1).with_inter_dc(1000.0, 0.0)
    path = str(tmp_path / "links")
    shapers = [LinkShaper.from_topology(topo, path=path) for _ in range(4)]

    def sender(s: LinkShaper) -> None:
        for _ in range(500):
            s.reserve(0, 1, 3)

    threads = [threading.Thread(target=sender, args=(s,)) for s in shapers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert shapers[0].totals()[0, 1] == 4 * 500 * 3
    assert shapers[0].messages[0, 1] == 2000
    for s in shapers:
        s.close()


@pytest.mark.parametrize("enabled", [True, False])
def test_cut_drops_a_pair_both_ways_until_healed(tmp_path, enabled: bool) -> None:
    """A cut made through one shaper (the driver) refuses messages booked through another
    (a worker) on that pair only, in both directions; heal brings the link back."""
    clock = FakeClock()
    topo = Topology.generate(3, 1).with_inter_dc(0.08, 20.0)
    path = str(tmp_path / "links")
    driver = LinkShaper.from_topology(topo, clock=clock, path=path)
    worker = LinkShaper.from_topology(topo, clock=clock, path=path, enabled=enabled)
    assert driver.links_up().all()
    driver.cut(0, 2)
    up = worker.links_up()
    assert not up[0, 2] and not up[2, 0] and up[0, 1] and up[1, 2] and up.diagonal().all()
    for a, b in [(0, 2), (2, 0)]:
        with pytest.raises(LinkDown, match="cut"):
            worker.reserve(a, b, 100)
    assert worker.totals()[0, 2] == 0  # a refused message is not counted
    worker.reserve(0, 1, 100)  # other pairs and the DC itself work
    worker.reserve(2, 2, 100)
    driver.heal(2, 0)
    assert worker.links_up().all()
    worker.reserve(0, 2, 100)
    assert worker.totals()[0, 2] == 100
    with pytest.raises(ValueError, match="pair"):
        driver.cut(1, 1)
    with pytest.raises(ValueError, match="pair"):
        driver.heal(0, 3)
    driver.close()
    worker.close()
