"""The fast loop's replica weights inside a DC, for one microbatch (FEPLB's two phases).

When the fast loop's quota solve (:func:`~expertmesh.workers.balance.solve`) gives a rank
tokens of an expert it does not hold, the rank fetches that expert's weights from a rank
of its DC that does, computes with the copy, and after the backward sends the copy's
gradients back to that home, where they add into the home's gradient (the slow loop's
reduction then carries them to the master). :class:`ReplicaFetch` does the three moves:

1. :meth:`~ReplicaFetch.start`: an asynchronous all-to-all in the DC's second group
   (``my_dc_aux``) sends the weights while the tokens are dispatched and the experts the
   rank already holds compute;
2. :meth:`~ReplicaFetch.wait`: the weights have landed; they become this microbatch's
   copies (:attr:`~ReplicaFetch.temp`, parameters so that the backward gives them
   gradients);
3. :meth:`~ReplicaFetch.return_grads`: the copies' gradients go back home (replica ->
   home) and the copies are dropped.

``fetch`` [F, 3] rows ``(src_local, dst_local, expert)`` (indices into the DC group) are
the same on every rank of the DC, so every rank computes the same send and receive sizes
without an exchange. Shapes: ``d`` hidden, ``f`` the experts' FFN hidden size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from expertmesh.workers.comm import Comm
from expertmesh.workers.model import ExpertWeights

__all__ = ["ReplicaFetch", "fetch_splits"]


def fetch_splits(
    fetch: np.ndarray, me: int, group_size: int, per: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """An all-to-all in a DC group of ``group_size`` over ``fetch`` [F, 3] rows
    ``(src_local, dst_local, expert)``, each moving ``per`` floats (one expert's three
    tensors): per-member send and receive counts of member ``me``, and the experts it sends
    and receives, in the order both sides use (by destination, then expert, when sending;
    by source, then expert, on arrival)."""
    send, recv = [0] * group_size, [0] * group_size
    rows = fetch.tolist()
    for s, t, _ in rows:
        if s == me:
            send[t] += per
        if t == me:
            recv[s] += per
    out = [e for s, t, e in sorted(rows, key=lambda x: (x[1], x[2])) if s == me]
    incoming = [e for s, t, e in sorted(rows, key=lambda x: (x[0], x[2])) if t == me]
    return send, recv, out, incoming


class ReplicaFetch:
    """One rank's fetched replicas of the current microbatch; see the module docstring.

    ``hidden`` (d) and ``ffn_hidden`` (f) fix the weights' shapes: W1, W3 [d, f], W2 [f, d].
    ``expert(e)`` gives the weights of an expert this rank holds (sent on fetch, and where
    returned gradients add up)."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        self.hidden, self.ffn_hidden = hidden, ffn_hidden
        self.temp: dict[int, ExpertWeights] = {}  # this microbatch's fetched replicas
        self.fetched = np.zeros((0, 3), np.int64)  # (src_local, dst_local, expert)
        self.fanout_bytes = 0  # replica weights this rank sent for this microbatch
        self.wait_seconds = 0.0  # waiting for replica weights not hidden by compute
        self._in_flight: tuple[Any, ...] | None = None

    def clear_stats(self) -> None:
        """A new forward: no copies yet, nothing sent, nothing waited for."""
        self.temp, self.fanout_bytes, self.wait_seconds = {}, 0, 0.0

    def _splits(
        self, comm: Comm, fetch: np.ndarray
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        per = 3 * self.hidden * self.ffn_hidden
        return fetch_splits(fetch, comm.my_dc.index[comm.rank], comm.my_dc.size, per)

    def start(self, comm: Comm, fetch: np.ndarray, expert: Callable[[int], ExpertWeights]) -> None:
        """Send the weights ``fetch`` [F, 3] asks of this rank, asynchronously, on the DC's
        second group; :meth:`wait` receives them."""
        self.fetched = fetch
        if fetch.size == 0:
            return
        send, recv, out, incoming = self._splits(comm, fetch)
        parts = [p.detach().reshape(-1) for e in out for p in expert(e)]
        flat = torch.cat(parts) if parts else torch.zeros(0, device=comm.device)
        self.fanout_bytes = int(flat.numel() * flat.element_size())
        got, work = comm.all_to_all_async(flat, send, recv, comm.my_dc_aux, "weights")
        self._in_flight = (got, work, incoming, flat)

    def wait(self) -> None:
        """The fetched replicas' weights, once they have landed, into :attr:`temp` (time
        waited is exposed: :attr:`wait_seconds`)."""
        if self._in_flight is None:
            return
        t0 = time.perf_counter()
        got, work, incoming, _ = self._in_flight
        if work is not None:
            work.wait()
        self._in_flight = None
        self.wait_seconds += time.perf_counter() - t0
        d, f = self.hidden, self.ffn_hidden
        at = 0
        for e in incoming:
            ts = []
            for shape in ((d, f), (d, f), (f, d)):
                n = shape[0] * shape[1]
                ts.append(nn.Parameter(got[at : at + n].reshape(shape).clone()))
                at += n
            self.temp[e] = (ts[0], ts[1], ts[2])

    def return_grads(self, comm: Comm, expert: Callable[[int], ExpertWeights]) -> None:
        """After the backward: the copies' gradients back to their homes, added into the
        home's gradient; the copies are dropped."""
        fetch = self.fetched
        if fetch.size == 0:
            return
        send, recv, out, incoming = self._splits(comm, fetch[:, [1, 0, 2]])  # replica -> home
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
            for e in out
            for p in self.temp[e]
        ]
        flat = torch.cat(parts) if parts else torch.zeros(0, device=comm.device)
        got = comm.all_to_all(flat, send, recv, comm.my_dc, "weights")
        at = 0
        for e in incoming:
            for p in expert(e):
                n = p.numel()
                g = got[at : at + n].reshape(p.shape)
                p.grad = g.clone() if p.grad is None else p.grad + g
                at += n
        self.fetched = np.zeros((0, 3), np.int64)
        self.temp = {}
