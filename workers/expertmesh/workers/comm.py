"""The process groups of one rank and the collectives the data plane runs over them.

Tensors move between ranks over ``torch.distributed`` (gloo on CPU, NCCL on CUDA), never
through Ray or a driver. :class:`Comm` holds the groups every rank forms in the same order:

- ``world``: every rank taking part (``members``; the group rank of expertmesh rank
  ``members[i]`` is ``i``);
- one group per DC (the domain inside which tokens fan out and replica gradients meet);
- ``leaders``: the lowest member rank of every DC (dense gradients cross the WAN there).

Every send that crosses a DC pair is charged to the :class:`LinkShaper` bucket of that
pair before the collective runs (the sender waits until its bytes would have arrived, so
a collective finishes when the slowest crossing does), and counted by kind (``tokens``,
``weights``, ``migration``). Off (``shaper=None``) only the counting remains, for real DCs.

:func:`exchange` is the one differentiable collective: an ``all_to_all`` of a 1-D tensor
whose backward is the ``all_to_all`` of the gradient the other way. Every rank issues the
same collectives in the same order; a step that would not is a bug, never a data-dependent
skip (a rank with nothing to send still takes part with empty splits).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from expertmesh.workers.shaper import LinkShaper

__all__ = ["KINDS", "Comm", "Group", "exchange", "pick_backend"]

KINDS = ("tokens", "weights", "migration")  # what crossed: activations, sync, plan moves


def pick_backend(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(eq=False)
class Group:
    """A process group: ``ranks`` (expertmesh ranks, ascending; the group rank of
    ``ranks[i]`` is ``i``) and the torch group (``None``: the default, world, group)."""

    ranks: list[int]
    pg: Any = None
    name: str = "world"  # which group: collectives on one name are counted in one sequence
    index: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.index = {r: i for i, r in enumerate(self.ranks)}

    @property
    def size(self) -> int:
        return len(self.ranks)


class Comm:
    """One rank's groups, shaper and byte counters. Build it on every rank of ``members``
    (after ``torch.distributed`` is initialized with ``len(members)`` processes) in the same
    order: it creates the DC and leader groups collectively."""

    def __init__(
        self,
        rank: int,
        rank_dc: np.ndarray,
        members: Sequence[int],
        *,
        shaper: LinkShaper | None = None,
        device: torch.device | str = "cpu",
        timeout_s: float = 60.0,
    ) -> None:
        members = sorted(int(r) for r in members)
        if rank not in members:
            raise ValueError(f"rank {rank} is not among the members {members}")
        self.rank, self.device = rank, torch.device(device)
        self.num_dcs = int(np.max(rank_dc)) + 1
        live = np.zeros(len(rank_dc), bool)
        live[members] = True
        self.live = live
        self.rank_dc = np.where(live, np.asarray(rank_dc), -1)  # [R]; -1: not taking part
        self.dc = int(self.rank_dc[rank])
        self.dc_ranks = [np.flatnonzero(self.rank_dc == d) for d in range(self.num_dcs)]
        self.world = Group(members)
        self.dcs: list[Group | None] = []
        for ranks in self.dc_ranks:  # every rank creates every group, in DC order
            pg = (
                _new_group([self.world.index[r] for r in ranks.tolist()], timeout_s)
                if ranks.size
                else None
            )
            self.dcs.append(Group(ranks.tolist(), pg, "dc") if ranks.size else None)
        self.dcs_aux: list[Group | None] = []  # a second group per DC: background transfers
        for ranks in self.dc_ranks:
            pg = (
                _new_group([self.world.index[r] for r in ranks.tolist()], timeout_s)
                if ranks.size
                else None
            )
            self.dcs_aux.append(Group(ranks.tolist(), pg, "dc_aux") if ranks.size else None)
        # a second world group: a new plan's weights move on it in the background while the
        # world group carries the step's tokens (ExpertParallel.prepare)
        self.world_aux = Group(
            members, _new_group(list(range(len(members))), timeout_s), "world_aux"
        )
        leaders = [int(r[0]) for r in self.dc_ranks if r.size]
        self.leaders = Group(
            leaders, _new_group([self.world.index[r] for r in leaders], timeout_s), "leaders"
        )
        self.shaper = shaper
        self.bytes = np.zeros((len(KINDS), self.num_dcs, self.num_dcs), np.int64)
        self.shaped_seconds = 0.0
        self.collectives = 0
        self._seq: dict[str, int] = {}  # collectives issued per group name
        # this rank's crossing sends per collective, until taken (take_crossed): (group
        # name, the collective's number on it, kind, [D] bytes to each DC)
        self.crossed: list[tuple[str, int, int, list[int]]] = []

    @property
    def my_dc(self) -> Group:
        g = self.dcs[self.dc]
        assert g is not None  # this rank is a member of its DC
        return g

    @property
    def my_dc_aux(self) -> Group:
        """This DC's second group: a transfer on it runs beside the DC group's collectives."""
        g = self.dcs_aux[self.dc]
        assert g is not None
        return g

    @property
    def leader(self) -> int:
        """The lowest rank of this rank's DC."""
        return int(self.dc_ranks[self.dc][0])

    # ---- shaping ----

    def _issue(self, group: Group) -> tuple[str, int]:
        """Count one collective on ``group``: its key ``(group name, number on it)``, the
        same on every member (every member issues a group's collectives in one order)."""
        self.collectives += 1
        n = self._seq.get(group.name, 0)
        self._seq[group.name] = n + 1
        return group.name, n

    def take_crossed(self) -> list[tuple[str, int, int, list[int]]]:
        """This rank's crossing sends per collective since the last call: ``(group name,
        collective number, kind index, [D] bytes to each DC)`` (a step's report carries
        them; the controller sums the members' into each collective's [D, D])."""
        out, self.crossed = self.crossed, []
        return out

    def charge(
        self,
        kind: str,
        nbytes_to: dict[int, int],
        *,
        wait: bool = True,
        key: tuple[str, int] | None = None,
    ) -> float:
        """Count and shape this rank's sends: ``nbytes_to`` expertmesh rank -> bytes. Waits
        until the crossing ones would have arrived over their DC pair's link (``wait=False``:
        books them and returns that clock time; the caller waits later, :meth:`settle`).
        ``key``: the collective they belong to (:meth:`_issue`), kept in :attr:`crossed`."""
        k = KINDS.index(kind)
        arrive = 0.0
        to_dc = [0] * self.num_dcs
        for q, nbytes in nbytes_to.items():
            b = int(self.rank_dc[q])
            if nbytes <= 0 or b == self.dc:
                continue
            self.bytes[k, self.dc, b] += nbytes
            to_dc[b] += int(nbytes)
            if self.shaper is not None:
                arrive = max(arrive, self.shaper.reserve(self.dc, b, nbytes))
        if key is not None and any(to_dc):
            self.crossed.append((key[0], key[1], k, to_dc))
        if wait:
            self.settle(arrive)
        return arrive

    def settle(self, arrive: float) -> None:
        """Sleep until clock time ``arrive`` (what :meth:`charge` booked), if it is ahead."""
        if arrive > 0:
            wait = arrive - time.time()
            if wait > 0:
                self.shaped_seconds += wait
                time.sleep(wait)

    # ---- collectives ----

    def all_to_all(
        self, x: torch.Tensor, send: Sequence[int], recv: Sequence[int], group: Group, kind: str
    ) -> torch.Tensor:
        """``all_to_all_single`` of 1-D ``x``: ``send[i]`` elements to ``group.ranks[i]``,
        ``recv[i]`` from it. Not differentiable (see :func:`exchange`)."""
        send, recv = [int(s) for s in send], [int(r) for r in recv]
        if len(send) != group.size or len(recv) != group.size or sum(send) != x.numel():
            raise ValueError(
                f"splits {send}/{recv} do not fit {x.numel()} elements, {group.size} ranks"
            )
        size = x.element_size()
        key = self._issue(group)
        self.charge(kind, {q: s * size for q, s in zip(group.ranks, send, strict=True)}, key=key)
        out = torch.empty(sum(recv), dtype=x.dtype, device=x.device)
        if group.size == 1:
            out.copy_(x)
            return out
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group.pg)
        return out

    def all_to_all_async(  # noqa: PLR0917
        self,
        x: torch.Tensor,
        send: Sequence[int],
        recv: Sequence[int],
        group: Group,
        kind: str,
        shaped: list[float] | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """:meth:`all_to_all` started in the background: ``(out, work)``; ``out`` is valid
        after ``work.wait()`` (``work`` is None when nothing had to move). ``shaped``: the
        link shaper's arrival time is appended there instead of being waited for now (the
        caller calls :meth:`settle` before using what arrived)."""
        send, recv = [int(s) for s in send], [int(r) for r in recv]
        if len(send) != group.size or len(recv) != group.size or sum(send) != x.numel():
            raise ValueError(f"splits {send}/{recv} do not fit {x.numel()} elements")
        size = x.element_size()
        key = self._issue(group)
        arrive = self.charge(
            kind, {q: s * size for q, s in zip(group.ranks, send, strict=True)},
            wait=shaped is None, key=key,
        )  # fmt: skip
        if shaped is not None:
            shaped.append(arrive)
        out = torch.empty(sum(recv), dtype=x.dtype, device=x.device)
        if group.size == 1:
            out.copy_(x)
            return out, None
        work = dist.all_to_all_single(
            out, x.contiguous(), recv, send, group=group.pg, async_op=True
        )
        return out, work

    def exchange_counts(self, counts: np.ndarray, group: Group, kind: str = "tokens") -> np.ndarray:
        """``counts`` [G, c] int: row ``i`` goes to ``group.ranks[i]``; returns [G, c], row
        ``i`` from ``group.ranks[i]``."""
        g, c = counts.shape
        t = torch.as_tensor(np.ascontiguousarray(counts, dtype=np.int64)).reshape(-1)
        out = self.all_to_all(t.to(self.device), [c] * g, [c] * g, group, kind)
        return out.cpu().numpy().reshape(g, c)

    def all_reduce(
        self, x: torch.Tensor, group: Group, kind: str = "weights", *, min_tail: int = 0
    ) -> torch.Tensor:
        """Sum ``x`` over ``group`` in place, bit-identical on every member: all-gather, then
        add in group order (a ring all-reduce's order depends on the rank). The last
        ``min_tail`` elements take the minimum instead (control words riding along)."""
        self._gather_sum(x, group, kind, min_tail)
        return x

    def all_reduce_rows(
        self, x: torch.Tensor, group: Group, rows: slice, *, min_tail: int = 0
    ) -> np.ndarray:
        """:meth:`all_reduce`, and every member's ``x[rows]`` as it was before the sum:
        [G, n] numpy, row ``i`` from ``group.ranks[i]`` (the sum is made from an all-gather,
        so the rows cost nothing more: a DC's lead reads its ranks' load counts here)."""
        parts = self._gather_sum(x, group, "weights", min_tail)
        return torch.stack([p[rows] for p in parts]).cpu().numpy()

    def _gather_sum(
        self, x: torch.Tensor, group: Group, kind: str, min_tail: int
    ) -> list[torch.Tensor]:
        if group.size == 1:
            return [x]
        parts = [torch.empty_like(x) for _ in range(group.size)]
        nbytes = x.numel() * x.element_size()
        key = self._issue(group)
        self.charge(kind, {q: nbytes for q in group.ranks if q != self.rank}, key=key)
        dist.all_gather(parts, x.contiguous(), group=group.pg)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        if min_tail:
            total[-min_tail:] = torch.stack([p[-min_tail:] for p in parts]).amin(0)
        x.copy_(total)
        return parts

    def all_gather_rows(self, row: np.ndarray, group: Group, kind: str = "tokens") -> np.ndarray:
        """``row`` [c] int of every member: [G, c], row ``i`` from ``group.ranks[i]``."""
        t = torch.as_tensor(np.ascontiguousarray(row, dtype=np.int64)).to(self.device)
        if group.size == 1:
            return t.cpu().numpy()[None]
        parts = [torch.empty_like(t) for _ in range(group.size)]
        nbytes = t.numel() * t.element_size()
        key = self._issue(group)
        self.charge(kind, {q: nbytes for q in group.ranks if q != self.rank}, key=key)
        dist.all_gather(parts, t, group=group.pg)
        return torch.stack(parts).cpu().numpy()

    def broadcast(self, x: torch.Tensor, src: int, group: Group, kind: str = "weights") -> None:
        """``x`` of expertmesh rank ``src`` to every member of ``group``, in place."""
        if group.size == 1:
            return
        key = self._issue(group)
        if self.rank == src:
            nbytes = x.numel() * x.element_size()
            self.charge(kind, {q: nbytes for q in group.ranks if q != src}, key=key)
        dist.broadcast(x, src=self.world.index[src], group=group.pg)

    def barrier_min(self, value: int) -> int:
        """The smallest ``value`` over the world (every rank gets the same answer)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        key = self._issue(self.world)
        if self.world.size > 1:
            self.charge("weights", {q: 8 for q in self.world.ranks if q != self.rank}, key=key)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def _new_group(group_ranks: list[int], timeout_s: float) -> Any:
    """A subgroup with the world's timeout (torch's default for subgroups is 30 minutes: a
    dead peer would hold a collective that long)."""
    if not dist.is_initialized():
        return None
    return dist.new_group(sorted(group_ranks), timeout=datetime.timedelta(seconds=timeout_s))


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: PLR0917
        ctx: Any,
        x: torch.Tensor,
        comm: Comm,
        send: list[int],
        recv: list[int],
        group: Group,
        kind: str,
    ) -> torch.Tensor:
        ctx.args = (comm, send, recv, group, kind)
        return comm.all_to_all(x, send, recv, group, kind)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        comm, send, recv, group, kind = ctx.args
        return (
            comm.all_to_all(g.contiguous(), recv, send, group, kind),
            None,
            None,
            None,
            None,
            None,
        )


def exchange(  # noqa: PLR0917
    x: torch.Tensor, comm: Comm, send: list[int], recv: list[int], group: Group, kind: str
) -> torch.Tensor:
    """Differentiable :meth:`Comm.all_to_all`: the gradient travels back the other way
    (``recv`` elements to each rank it came from), shaped and counted the same."""
    out: torch.Tensor = _Exchange.apply(x, comm, send, recv, group, kind)
    return out
