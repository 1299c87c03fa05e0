"""The rendezvous store of a new SPMD process group (expertmesh.runtime.worker).

The first member's worker opens the store itself and keeps the port bound from then on:
before, it picked a free port, closed it, and the store bound it later, so another process
could take the port in between (EADDRINUSE at the next re-form)."""

from __future__ import annotations

import datetime
import errno
import multiprocessing as mp
import socket

import pytest

from expertmesh.runtime.worker import connect_store, listen_store


def test_the_store_holds_its_port_from_the_moment_it_is_named() -> None:
    stores = [listen_store("127.0.0.1", 5.0) for _ in range(2)]
    ports = [int(s.port) for s in stores]
    assert ports[0] != ports[1] and all(p > 0 for p in ports)
    for port in ports:  # nobody else can take it: it is bound and listening
        with socket.socket() as s, pytest.raises(OSError) as err:
            s.bind(("127.0.0.1", port))
        assert err.value.errno == errno.EADDRINUSE
    client = connect_store("127.0.0.1", ports[1], 5.0)
    client.set("k", "v")
    assert stores[1].get("k") == b"v"


def _rank(rank: int, port: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    import torch
    import torch.distributed as dist

    store = connect_store("127.0.0.1", port, 20.0)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20)
    )
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    q.put(float(t.item()))
    dist.destroy_process_group()


def test_a_gloo_group_forms_through_the_store() -> None:
    store = listen_store("127.0.0.1", 20.0)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, int(store.port), q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(q.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    assert got == [3.0, 3.0]
