"""A rank process's side of its process groups, below the worker actor's logic.

The rendezvous store a new group meets at (:func:`listen_store` on the group's first
member, :func:`connect_store` on the others), leaving the groups without hanging on a dead
peer (:func:`leave_group`), the interface gloo binds its sockets to (:func:`interface_of`)
and pinning the process to its CPUs (:func:`pin_process`). Used by
:class:`~expertmesh.runtime.worker.SpmdWorker`; no Ray here.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading
from typing import Any

import torch.distributed as dist

__all__ = ["connect_store", "interface_of", "leave_group", "listen_store", "pin_process"]

log = logging.getLogger(__name__)


def listen_store(host: str, timeout_s: float) -> Any:
    """A new process group's rendezvous store, listening on ``host`` at a port the kernel
    picks and this store holds from then on (``.port``); no window in which another
    process can take the port (as with picking a free port, closing it, and binding later)."""
    return dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip


def connect_store(host: str, port: int, timeout_s: float) -> Any:
    """A client of the store :func:`listen_store` opened on ``host:port`` (bounded)."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def leave_group(rank: int, timeout_s: float = 10.0) -> None:
    """Destroy this process's groups; bounded (a destroy waiting on a dead peer's pending
    work is left behind in its thread, and the next init starts afresh)."""
    if not dist.is_initialized():
        return

    def destroy() -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    t = threading.Thread(target=destroy, daemon=True)
    t.start()
    t.join(timeout_s)
    log.warning(
        "rank %d left its process group%s", rank, "" if not t.is_alive() else " (timed out)"
    )


def pin_process(cpus: set[int]) -> set[int]:
    """Pin every thread of this process to ``cpus`` (threads started later by them inherit
    it; Linux: ``/proc/self/task``). Returns the calling thread's CPUs afterwards."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)
    return set(os.sched_getaffinity(0))


def interface_of(ip: str) -> str | None:
    """The network interface that holds ``ip`` (gloo binds its sockets there)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return None
