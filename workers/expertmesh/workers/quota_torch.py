"""Per-microbatch quota inside one domain on torch tensors (issue 12): what a worker calls.

After the gate, the ranks of a domain all-gather their counts in the domain's process
group and every rank calls :func:`balance` on the same input; the answer is the same on
every rank (plain integer arithmetic, ties by id), so no rank waits for another::

    balance(counts [R_src, E] int (torch or numpy), phy2log [R, S] int,
            settings=DEFAULTS, *, impl="auto") -> DomainBalance | TorchBalance

- ``counts[r, e]``: tokens source row ``r`` sends to expert ``e`` this microbatch; rows
  ``0 .. R-1`` are the domain's ranks in order, rows ``R ..`` (optional) sources outside
  the domain that send tokens in. ``phy2log[r, s]``: expert in slot ``s`` of rank ``r``
  before this microbatch's replicas, each expert at most once in the domain (its home:
  master or slow-loop copy), ``-1`` for a free slot. Every expert with tokens is held.
- The result (numpy input: :class:`~expertmesh.planner.fastquota.DomainBalance`; torch
  input: :class:`TorchBalance`, the same fields as tensors on ``counts.device``):
  ``replicas`` [N, 3] ``(rank, slot, expert)`` to fill, in line order;
  ``replica_tokens`` [N]; ``copy_rank``, ``copy_expert`` [C] (the replicas, then the
  home of each replicated expert, experts ascending) and ``split`` [C, R_src]: tokens
  from each source row to each copy; every other expert's tokens go whole to
  ``home_rank[e]`` ([E], -1 where not held); ``rank_tokens`` [R]; ``quota`` (the ``T``
  used), ``smallest``, ``lower_bound`` (ints).
- ``settings``: :class:`~expertmesh.planner.fastquota.BalanceSettings` (tolerance,
  minimum tokens per replica, bound on replicas per expert; ``docs/quota.md``).
- Replicas that repeat from the last microbatch: ``fastquota.reuse_slots(replicas,
  phy2log, cached)`` moves them to the slot that still holds their weights and says which
  replicas need weights sent (``fresh``).
- ``impl``: ``"numpy"`` (:func:`~expertmesh.planner.fastquota.balance_domain`; CPU
  tensors are shared with numpy, not copied), ``"torch"`` (:func:`balance_torch`), or
  ``"auto"``: numpy on every device. Device counts cost a copy to the host and the split
  a copy back, and that is still faster than the torch split's few dozen small kernels:
  on an H200, 0.43 / 0.62 / 0.93 ms against 1.66 / 2.40 / 2.73 ms at 8 / 16 / 64 ranks
  (``bench/bench_gpu.py``, docs/benchmarks.md "On a GPU"); on the CPU numpy makes fewer,
  cheaper calls. ``"torch"`` stays for counts too large to copy.

:func:`balance_torch` is the same solve as the numpy one and gives equal results
(``tests/unit/test_quota_torch.py``): the decision (which ``T``, which replicas) is a
walk over ``E``-sized vectors in plain Python ints, shared with the numpy solve, run on
the host from the ``[E]`` demand (one ``[E]`` copy from the device); the ``[C, R_src]``
token split, the only part that grows with the counts, runs in torch on the counts'
device (its ``[C]`` index bookkeeping stays on the host, where the replicas are made, so
the device sees a few dozen kernels and no atomics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from expertmesh.planner.fastquota import (
    DEFAULTS,
    BalanceSettings,
    DomainBalance,
    balance_domain,
    choose,
    replica_table,
    setup,
)

__all__ = ["TorchBalance", "balance", "balance_torch"]

_INT = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass(frozen=True, eq=False)
class TorchBalance:
    """:class:`~expertmesh.planner.fastquota.DomainBalance` with int64 tensors on the
    counts' device (same fields, same meaning)."""

    quota: int
    smallest: int
    lower_bound: int
    replicas: torch.Tensor
    replica_tokens: torch.Tensor
    home_rank: torch.Tensor
    copy_rank: torch.Tensor
    copy_expert: torch.Tensor
    split: torch.Tensor
    rank_tokens: torch.Tensor

    def numpy(self) -> DomainBalance:
        """The same result as numpy arrays (on the host)."""
        return DomainBalance(
            self.quota,
            self.smallest,
            self.lower_bound,
            *(
                t.cpu().numpy()
                for t in (
                    self.replicas,
                    self.replica_tokens,
                    self.home_rank,
                    self.copy_rank,
                    self.copy_expert,
                    self.split,
                    self.rank_tokens,
                )
            ),
        )


def _check(counts: torch.Tensor, phy2log: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """``counts`` as int64 on its device, ``phy2log`` as int64 on the host; ``ValueError``
    on shapes, dtypes or values the solve cannot take."""
    if counts.ndim != 2 or counts.dtype not in _INT:
        raise ValueError(
            f"counts must be [R_src, E] integer, got {tuple(counts.shape)} {counts.dtype}"
        )
    if phy2log.ndim != 2 or phy2log.dtype not in _INT:
        raise ValueError(
            f"phy2log must be [R, S] integer, got {tuple(phy2log.shape)} {phy2log.dtype}"
        )
    num_ranks, num_experts = phy2log.shape[0], counts.shape[1]
    if counts.shape[0] < num_ranks or num_ranks == 0:
        raise ValueError(f"counts has {counts.shape[0]} source rows for {num_ranks} ranks")
    p2l = phy2log.detach().cpu().numpy().astype(np.int64)
    if p2l.size and (p2l.min() < -1 or p2l.max() >= num_experts):
        raise ValueError(f"phy2log holds an expert outside -1 .. {num_experts - 1}")
    return counts.detach().to(torch.int64), p2l


def balance_torch(
    counts: torch.Tensor, phy2log: torch.Tensor, settings: BalanceSettings = DEFAULTS
) -> TorchBalance:
    """The solve of :func:`~expertmesh.planner.fastquota.balance_domain` with the token
    split in torch on ``counts.device`` (module docstring). ``ValueError`` as there."""
    counts, p2l = _check(counts, phy2log)
    dev = counts.device
    demand_t = counts.sum(dim=0)  # [E]
    if counts.numel() and int(counts.min()) < 0:
        raise ValueError("load has negative token counts")
    demand = demand_t.cpu().numpy()
    pb, home_rank, empty = setup(demand, p2l, settings.max_replicas_per_expert)
    quota, smallest, segs = choose(pb, settings)
    seg = np.array(segs, np.int64).reshape(-1, 4)  # [N] expert, rank, tokens, j
    replicas, rank_tokens = replica_table(seg, empty, p2l.shape[1], home_rank, pb.work)
    home_t = torch.from_numpy(home_rank).to(dev)
    copy_rank, copy_expert, split = _split(counts, home_rank, seg)

    def put(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(x).to(dev)

    return TorchBalance(
        quota=quota,
        smallest=smallest,
        lower_bound=pb.lower,
        replicas=put(replicas),
        replica_tokens=put(seg[:, 2].copy()),
        home_rank=home_t,
        copy_rank=copy_rank,
        copy_expert=copy_expert,
        split=split,
        rank_tokens=put(rank_tokens),
    )


def _split(
    counts: torch.Tensor, home_rank: np.ndarray, seg: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fastquota._split`` with its ``[C, R_src]`` arithmetic in torch on the counts'
    device: each copy its own rank's tokens first, then replica ``j`` of every expert,
    pass by pass, in proportion with the largest remainders (lower source on ties); the
    home takes the rest. ``counts`` [R_src, E] int64; ``seg`` [N, 4] (expert, rank,
    tokens, j) on the host, where the copies' bookkeeping ([C] indices) stays."""
    dev, num_src = counts.device, counts.shape[0]
    n = seg.shape[0]
    if not n:
        z = torch.zeros(0, dtype=torch.int64, device=dev)
        return z, z, torch.zeros((0, num_src), dtype=torch.int64, device=dev)
    hot = np.flatnonzero(np.bincount(seg[:, 0], minlength=counts.shape[1]))  # [K]
    col = np.searchsorted(hot, seg[:, 0])  # [N]
    k = hot.size
    c_col_np = np.concatenate([col, np.arange(k)])  # [C]
    c_rank_np = np.concatenate([seg[:, 1], home_rank[hot]])
    given = np.bincount(col, weights=seg[:, 2], minlength=k).astype(np.int64)

    def put(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(dev)

    c_col, c_rank = put(c_col_np), put(c_rank_np)
    left = counts.index_select(1, put(hot)).T.contiguous()  # [K, R_src]
    need = torch.cat([put(seg[:, 2]), left.sum(dim=1) - put(given)])  # [C]
    own = torch.minimum(need, left[c_col, c_rank])  # own rank first
    left[c_col, c_rank] -= own
    need -= own
    split = torch.empty((n + k, num_src), dtype=torch.int64, device=dev)
    rev = torch.arange(num_src - 1, -1, -1, device=dev)  # remainder ties to the lower source
    top = torch.iinfo(torch.int64).max
    for j in range(int(seg[:, 3].max()) + 1):
        c_np = np.flatnonzero(seg[:, 3] == j)
        c, cols = put(c_np), put(c_col_np[c_np])
        w, nd = left[cols], need[c]  # [n_j, R_src], [n_j]
        num = w * nd[:, None]
        tot = w.sum(dim=1).clamp(min=1)[:, None]
        share = torch.div(num, tot, rounding_mode="floor")
        rem = num - share * tot
        short = nd - share.sum(dim=1)  # < R_src tokens the floors leave out
        key = rem * num_src + rev  # distinct within a row
        ranked = torch.sort(key, dim=1).values
        cut = ranked[torch.arange(c_np.size, device=dev), num_src - short.clamp(min=1)]
        cut = torch.where(short > 0, cut, torch.full_like(cut, top))
        share += (key >= cut[:, None]).to(torch.int64)
        left[cols] = w - share
        split[c] = share
    split[n:] = left
    split[torch.arange(n + k, device=dev), c_rank] += own
    return c_rank, put(np.concatenate([seg[:, 0], hot])), split


def balance(
    counts: torch.Tensor | np.ndarray,
    phy2log: torch.Tensor | np.ndarray,
    settings: BalanceSettings = DEFAULTS,
    *,
    impl: Literal["auto", "numpy", "torch"] = "auto",
) -> DomainBalance | TorchBalance:
    """The worker's entry point (module docstring): numpy in, :class:`DomainBalance` out;
    torch in, :class:`TorchBalance` on ``counts.device`` out."""
    if impl not in ("auto", "numpy", "torch"):
        raise ValueError(f"impl must be auto, numpy or torch, got {impl!r}")
    if not isinstance(counts, torch.Tensor):
        if impl == "torch":
            return balance_torch(torch.as_tensor(counts), torch.as_tensor(phy2log), settings)
        return balance_domain(np.asarray(counts), np.asarray(phy2log), settings)
    p2l = phy2log if isinstance(phy2log, torch.Tensor) else torch.as_tensor(phy2log)
    if impl == "torch":
        return balance_torch(counts, p2l, settings)
    sol = balance_domain(counts.detach().cpu().numpy(), p2l.detach().cpu().numpy(), settings)
    dev = counts.device
    return TorchBalance(
        sol.quota,
        sol.smallest,
        sol.lower_bound,
        *(
            torch.from_numpy(x).to(dev)
            for x in (
                sol.replicas,
                sol.replica_tokens,
                sol.home_rank,
                sol.copy_rank,
                sol.copy_expert,
                sol.split,
                sol.rank_tokens,
            )
        ),
    )
