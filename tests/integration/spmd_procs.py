"""Run a function on every rank of a world of real processes on this machine (no Ray).

Each rank is a spawned process that initializes ``torch.distributed`` (a file store in a
temp dir), builds its :class:`~expertmesh.workers.comm.Comm` and calls ``fn(comm,
*args)``; what ``fn`` returns comes back, by rank. ``device="cpu"``: gloo. ``"cuda"``:
every tensor of the rank on a CUDA device; NCCL with one device per rank where there are
enough (NCCL refuses two ranks on one device), else gloo's CUDA collectives with the
ranks sharing the devices round-robin (the data plane's tensor paths on the device,
without NCCL). Bounded: a process that does
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


def cuda_backend(world: int) -> str:
    """The backend a CUDA world of ``world`` ranks gets (module docstring)."""
    import torch

    return "nccl" if torch.cuda.device_count() >= world else "gloo"


def _main(fn: Callable[..., Any], rank: int, rank_dc: np.ndarray, store: str, q: Any,
          args: tuple[Any, ...], timeout: float, device: str) -> None:  # fmt: skip
    import torch
    import torch.distributed as dist

    from expertmesh.workers.comm import Comm

    try:
        n = len(rank_dc)
        backend, dev = "gloo", torch.device("cpu")
        if device == "cuda":
            backend, dev = cuda_backend(n), torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(dev)
            # the reference is fp32 on the CPU: no TF32 in cuDNN's convolutions either
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        dist.init_process_group(
            backend, init_method=f"file://{store}", rank=rank, world_size=n,
            timeout=datetime.timedelta(seconds=timeout),
        )  # fmt: skip
        comm = Comm(rank, rank_dc, list(range(n)), device=dev)
        q.put((rank, "ok", fn(comm, *args)))
        dist.destroy_process_group()
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    rank_dc: np.ndarray,
    *args: Any,
    timeout: float = 120.0,
    device: str = "cpu",
) -> list[Any]:
    """``fn(comm, *args)`` on every rank (``fn`` importable at module level)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_main, args=(fn, r, np.asarray(rank_dc), store, q, args, timeout, device)
            )
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
