"""Pure pieces of the expert-parallel MoE layer (no Ray, no I/O; :mod:`expertmesh.workers.layer`
uses them).

- :func:`assign_destinations`: which rank computes each of a source rank's
  top-k assignments, following the committed plan's route.
- :func:`split_destinations`: the same from a per-microbatch split by DC
  (:func:`~expertmesh.planner.dcsplit.split_dcs`), to a holder in each DC.
- :func:`relay_rank`: the rank of a remote DC that receives a source's WAN
  bundle and fans it out inside that DC (hierarchical dispatch);
  :func:`relay_counts`: what each rank of a DC holds after that dispatch.
- :func:`adam_`: the optimizer step masters (and every rank, for dense weights) run.

Shapes: ``n`` tokens, ``k`` top-k, ``d`` hidden, ``E`` experts, ``R`` ranks,
``m`` assignments (token, expert) received by a rank, ``u`` distinct tokens.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "adam_",
    "assign_destinations",
    "largest_remainder",
    "relay_counts",
    "relay_rank",
    "split_destinations",
]


def largest_remainder(total: int, weights: np.ndarray, offset: int = 0) -> np.ndarray:
    """Split ``total`` into ``len(weights)`` integers proportional to ``weights`` [c] >= 0
    (sum > 0); leftover units go to the largest fractional parts, ties broken starting at
    index ``offset % c`` so no copy is always favoured. Returns [c] int64 summing to total."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError("weights must be a non-empty 1-D array of non-negative numbers, sum > 0")
    exact = total * w / w.sum()
    base = np.floor(exact).astype(np.int64)
    left = int(total - base.sum())
    if left:
        c = w.size
        tie = (np.arange(c) - offset) % c
        order = np.lexsort((tie, -(exact - base)))
        base[order[:left]] += 1
    return base


def assign_destinations(
    rank: int,
    idx: np.ndarray,
    route: np.ndarray,
    holds: np.ndarray,
    rank_dc: np.ndarray,
) -> np.ndarray:
    """Destination rank of every assignment of source ``rank``.

    - ``idx``: [n, k] expert of each token's k-th choice.
    - ``route``: [N, 4] the committed plan's rows ``(src_rank, expert, dst_rank, tokens)``;
      the rows of ``(rank, e)`` give the shares in which this microbatch's tokens for ``e``
      are split (largest remainder, token order). A ``(rank, e)`` the plan did not see
      goes evenly to the copies of ``e`` in this rank's DC, else to all copies.
    - ``holds``: [R, E] bool, the committed placement.
    - ``rank_dc``: [R] DC of each rank.

    Returns ``dst`` [n, k] int64. ``ValueError`` if the route names a rank without the expert
    or an expert has no copy.
    """
    flat = idx.reshape(-1)
    dst = np.empty(flat.size, dtype=np.int64)
    mine = route[route[:, 0] == rank] if route.size else np.zeros((0, 4), np.int64)
    order = np.argsort(flat, kind="stable")  # assignments grouped by expert, token order kept
    experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    for e, s, c in zip(experts.tolist(), starts.tolist(), counts.tolist(), strict=True):
        rows = mine[(mine[:, 1] == e) & (mine[:, 3] > 0)]
        if rows.size:
            ranks, shares = rows[:, 2], rows[:, 3]
        else:
            holders = np.flatnonzero(holds[:, e])
            if holders.size == 0:
                raise ValueError(f"expert {e} has no copy in the committed placement")
            local = holders[rank_dc[holders] == rank_dc[rank]]
            ranks = local if local.size else holders
            shares = np.ones(ranks.size)
        if not holds[ranks, e].all():
            raise ValueError(f"the route sends expert {e} to a rank that does not hold it")
        split = largest_remainder(c, shares, offset=rank)
        dst[order[s : s + c]] = np.repeat(ranks, split)
    return dst.reshape(idx.shape)


def split_destinations(idx: np.ndarray, tokens: np.ndarray, holder: np.ndarray) -> np.ndarray:
    """Destination rank of every assignment of one source rank, by a split per DC.

    - ``idx``: [n, k] expert of each token's k-th choice;
    - ``tokens``: [E, D] this rank's tokens of each expert that each DC computes (row ``e``
      sums to the assignments of ``e`` in ``idx``); in token order, DC by DC;
    - ``holder``: [D, E] the rank of DC ``d`` that receives its tokens of ``e`` (a rank
      holding ``e``; the DC's fast loop decides which of its ranks computes them), ``-1``
      where the DC holds no copy.

    Returns ``dst`` [n, k] int64. ``ValueError`` if a row does not match ``idx`` or sends
    tokens to a DC without a copy."""
    flat = idx.reshape(-1)
    dst = np.empty(flat.size, dtype=np.int64)
    have = np.bincount(flat, minlength=tokens.shape[0])
    rows = tokens.sum(axis=1)
    if have.size != tokens.shape[0] or (rows != have).any():
        bad = np.flatnonzero(rows != have[: tokens.shape[0]])[:1].tolist()
        raise ValueError(f"the split of expert {bad} does not fit its assignments")
    nowhere = ((tokens > 0) & (holder.T < 0)).any(axis=1)  # [E] tokens to a DC without a copy
    if nowhere.any():
        raise ValueError(f"the split of expert {int(np.argmax(nowhere))} does not fit its holders")
    order = np.argsort(flat, kind="stable")
    experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    for e, s, c in zip(experts.tolist(), starts.tolist(), counts.tolist(), strict=True):
        dst[order[s : s + c]] = np.repeat(holder[:, e], tokens[e])
    return dst.reshape(idx.shape)


def relay_counts(tokens: np.ndarray, dc: int, rank_dc: np.ndarray) -> np.ndarray:
    """[Rd, E] assignments each rank of DC ``dc`` holds after the cross-DC dispatch (its
    own, and what arrives as relay: :func:`relay_rank`), from ``tokens`` [R, E, D], the
    world's split by DC; ``rank_dc`` [R] (``-1``: not taking part). Rows: the DC's ranks
    ascending."""
    ranks = np.flatnonzero(rank_dc == dc)
    pos = np.zeros(rank_dc.size, np.int64)  # each rank's index inside its DC
    for d in np.unique(rank_dc[rank_dc >= 0]).tolist():
        members = np.flatnonzero(rank_dc == d)
        pos[members] = np.arange(members.size)
    live = np.flatnonzero(rank_dc >= 0)
    out = np.zeros((ranks.size, tokens.shape[1]), np.int64)
    np.add.at(out, pos[live] % ranks.size, tokens[live, :, dc])
    return out


def relay_rank(src: int, dc: int, rank_dc: np.ndarray) -> int:
    """The rank of DC ``dc`` that receives ``src``'s bundle for that DC: the rank with the
    same index inside its DC as ``src`` in its own (modulo the DC's size)."""
    src_ranks = np.flatnonzero(rank_dc == rank_dc[src])
    dst_ranks = np.flatnonzero(rank_dc == dc)
    if dst_ranks.size == 0:
        raise ValueError(f"DC {dc} has no ranks")
    i = int(np.searchsorted(src_ranks, src))
    return int(dst_ranks[i % dst_ranks.size])


def adam_(  # noqa: PLR0917
    param: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: int,
    lr: float,
    *,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
) -> None:
    """One Adam step in place (``step`` counts from 1)."""
    b1, b2 = betas
    with torch.no_grad():
        m.mul_(b1).add_(grad, alpha=1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        mhat = m / (1 - b1**step)
        vhat = v / (1 - b2**step)
        param.sub_(lr * mhat / (vhat.sqrt() + eps))
