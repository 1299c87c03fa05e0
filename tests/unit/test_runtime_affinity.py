"""Pinning a rank's worker process to CPUs (``RuntimeSettings.worker_cpus``): the settings
check one set per rank, and :func:`pin_process` pins every thread of the process, those
started before the call too (Ray's actor threads are), not only the caller."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest
from pydantic import ValidationError

from expertmesh.planner import Topology
from expertmesh.runtime.settings import RuntimeSettings
from expertmesh.runtime.worker import pin_process

TOPO = Topology.generate(1, 2, masters=2, spare=1).to_dict()  # one DC of 2 ranks


def test_one_cpu_set_per_rank() -> None:
    assert RuntimeSettings(topology=TOPO, worker_cpus=[[0], [1]]).worker_cpus == [[0], [1]]
    assert RuntimeSettings(topology=TOPO).worker_cpus is None
    for bad in ([[0]], [[0], [1], [0]], [[0], []], [[0], [-1]]):
        with pytest.raises(ValidationError, match="worker_cpus"):
            RuntimeSettings(topology=TOPO, worker_cpus=bad)


def _threads_cpus(cpu: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    stop = threading.Event()
    early = threading.Thread(target=stop.wait)  # started before the pin
    early.start()
    mine = pin_process({cpu})
    late = threading.Thread(target=stop.wait)  # inherits the caller's
    late.start()
    tasks = sorted(os.listdir("/proc/self/task"))
    out.put((sorted(mine), {t: sorted(os.sched_getaffinity(int(t))) for t in tasks}))
    stop.set()
    early.join()
    late.join()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux only")
def test_pin_process_pins_every_thread() -> None:
    cpu = min(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_threads_cpus, args=(cpu, out))
    p.start()
    mine, threads = out.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    assert mine == [cpu]
    assert len(threads) >= 3  # main, early, late
    assert all(cpus == [cpu] for cpus in threads.values()), threads
