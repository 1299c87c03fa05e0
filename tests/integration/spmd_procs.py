"""Run a function on every rank of a gloo world of real processes on this machine (no Ray).

Each rank is a spawned process that initializes ``torch.distributed`` (gloo, a file
store in a temp dir), builds its :class:`~expertmesh.workers.comm.Comm` and calls
``fn(comm, *args)``; what ``fn`` returns comes back, by rank. Bounded: a process that does
not answer within ``timeout`` seconds fails the call, and every process is ended."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np


def _main(fn: Callable[..., Any], rank: int, rank_dc: np.ndarray, store: str, q: Any,
          args: tuple[Any, ...], timeout: float) -> None:  # fmt: skip
    import torch.distributed as dist

    from expertmesh.workers.comm import Comm

    try:
        n = len(rank_dc)
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=n,
            timeout=datetime.timedelta(seconds=timeout),
        )  # fmt: skip
        comm = Comm(rank, rank_dc, list(range(n)))
        q.put((rank, "ok", fn(comm, *args)))
        dist.destroy_process_group()
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any], rank_dc: np.ndarray, *args: Any, timeout: float = 120.0
) -> list[Any]:
    """``fn(comm, *args)`` on every rank (``fn`` importable at module level)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_main, args=(fn, r, np.asarray(rank_dc), store, q, args, timeout))
            for r in range(len(rank_dc))
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout + 30
        try:
            while len(out) < len(procs):
                try:
                    rank, status, val = q.get(timeout=1.0)
                except queue.Empty:
                    missing = sorted(set(range(len(procs))) - set(out))
                    dead = [r for r in missing if not procs[r].is_alive()]
                    if dead or time.monotonic() > deadline:
                        raise TimeoutError(f"ranks {dead or missing} ended or hung") from None
                    continue
                if status != "ok":
                    raise RuntimeError(f"rank {rank} failed:\n{val}")
                out[rank] = val
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return [out[r] for r in range(len(rank_dc))]
