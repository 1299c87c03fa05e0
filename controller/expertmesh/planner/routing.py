"""Shared token routing: split each ``load[r, e]`` among the copies of ``e``.

Policies that do not route by quota (``static``, ``eplb``, ``fastermoe``) use
:func:`route_even`: tokens of ``(r, e)`` go evenly to the copies of ``e`` in
``r``'s domain when that domain holds any, else evenly to all copies; the
remainder goes one token each to copies picked round-robin from ``r``, so no
copy is favoured across sources.

``quota`` uses :func:`route_locality`: every copy computes a given amount, its
own rank's tokens first, the rest split among sources by largest remainder.
"""

from __future__ import annotations

import numpy as np

from expertmesh.planner.plan import Placement

__all__ = ["route_even", "route_locality"]


def route_even(
    load: np.ndarray, placement: Placement, domain_of_rank: np.ndarray | None = None
) -> np.ndarray:
    """Route ``load`` [R, E] over ``placement``; returns route [N, 4] int64.

    ``domain_of_rank``: [R] int domain id of each rank, or ``None`` for one
    domain. Every expert with load must have a copy (``ValueError`` otherwise).
    """
    num_ranks, num_experts = load.shape
    dom = (
        np.zeros(num_ranks, dtype=np.int64)
        if domain_of_rank is None
        else np.asarray(domain_of_rank)
    )
    if dom.shape != (num_ranks,):
        raise ValueError(f"domain_of_rank must be [{num_ranks}], got {dom.shape}")
    num_domains = int(dom.max()) + 1
    cr, cs = np.nonzero(placement.phy2log >= 0)
    ce = placement.phy2log[cr, cs].astype(np.int64)
    # copies sorted by (expert, domain): a group is a contiguous run
    cd = dom[cr]
    order = np.lexsort((cr, cd, ce))
    cr, ce, cd = cr[order], ce[order], cd[order]
    key = ce * num_domains + cd
    dom_start = np.searchsorted(key, np.arange(num_experts * num_domains))  # [E*D]
    dom_count = np.bincount(key, minlength=num_experts * num_domains)
    exp_start = np.searchsorted(ce, np.arange(num_experts))  # [E]
    exp_count = np.bincount(ce, minlength=num_experts)

    src, exp = np.nonzero(load)
    tokens = load[src, exp]
    if (exp_count[exp] == 0).any():
        missing = np.unique(exp[exp_count[exp] == 0])
        raise ValueError(f"experts with load but no copy: {missing[:8].tolist()}")
    k = exp * num_domains + dom[src]
    local = dom_count[k] > 0
    start = np.where(local, dom_start[k], exp_start[exp])
    count = np.where(local, dom_count[k], exp_count[exp])

    rows = np.repeat(np.arange(src.size), count)  # one row per (pair, copy)
    j = np.arange(rows.size) - np.repeat(np.cumsum(count) - count, count)  # copy index in group
    c = count[rows]
    base, rem = tokens[rows] // c, tokens[rows] % c
    extra = ((j - src[rows]) % c) < rem
    out = np.empty((rows.size, 4), dtype=np.int64)
    out[:, 0] = src[rows]
    out[:, 1] = exp[rows]
    out[:, 2] = cr[start[rows] + j]
    out[:, 3] = base + extra
    return out[out[:, 3] > 0]


def route_locality(
    load: np.ndarray,
    master_rank: np.ndarray,
    replicas: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> np.ndarray:
    """Route [N, 4] of ``load`` [R, E] when each copy computes a given amount.

    ``master_rank``: [E]; ``replicas``: ``(expert, rank, tokens)`` each [N], at most one
    per (expert, rank), away from the master's rank, tokens summing to at most the
    expert's load. An expert without replicas goes whole to its master. For the
    others, each copy (the master computes what its replicas leave) first takes its
    own rank's tokens; then replica ``j`` of each expert (in the order given) splits
    what it still needs among the sources' remaining tokens in proportion, rounded by
    largest remainder (lower rank on ties); the master takes what is left. Vectorized
    over experts: one pass per replica index ``j``.
    """
    rep_expert, rep_rank, rep_tokens = replicas
    num_ranks, num_experts = load.shape
    hot = np.unique(rep_expert)  # [K] experts with replicas
    col = np.full(num_experts, -1)
    col[hot] = np.arange(hot.size)
    # copies of the hot experts: replicas in line order, then the masters
    c_exp, c_rank = np.concatenate([rep_expert, hot]), np.concatenate([rep_rank, master_rank[hot]])
    left = load[:, hot].T.copy()  # [K, R] tokens of each source not yet given to a copy
    given = np.bincount(col[rep_expert], weights=rep_tokens, minlength=hot.size).astype(np.int64)
    c_need = np.concatenate([rep_tokens, left.sum(axis=1) - given])  # [C]
    c_col = col[c_exp]
    take = np.zeros((c_exp.size, num_ranks), dtype=np.int64)  # [C, R]
    own = np.minimum(c_need, left[c_col, c_rank])  # own rank first (added to take below)
    left[c_col, c_rank] -= own
    c_need -= own
    rank_desc = np.arange(num_ranks - 1, -1, -1)  # [R] breaks remainder ties to the lower rank
    nth = _nth_of_group(rep_expert)  # replica j of its expert, [N]
    by_nth = np.argsort(nth, kind="stable")
    for c in np.split(by_nth, np.flatnonzero(np.diff(nth[by_nth])) + 1) if nth.size else []:
        cols, need = c_col[c], c_need[c]  # replica j of every expert that has one
        w = left[cols]  # [n, R]
        share, rem = np.divmod(w * need[:, None], np.maximum(w.sum(axis=1), 1)[:, None])
        short = need - share.sum(axis=1)  # tokens the floors leave out, < R
        if short.any():  # one more to the `short` largest remainders (lower rank on ties):
            key = rem * num_ranks + rank_desc  # [n, R] distinct within a row
            nth_key = np.sort(key, axis=1)[np.arange(c.size), num_ranks - np.maximum(short, 1)]
            share += key >= np.where(short > 0, nth_key, np.iinfo(np.int64).max)[:, None]
        left[cols] = w - share
        take[c] = share  # nothing from its own rank: that is empty or not needed any more
    take[rep_expert.size :] += left  # masters take the rest
    take[np.arange(c_exp.size), c_rank] += own
    flat = np.flatnonzero(take)  # (copy, source) pairs with tokens
    copy, src = np.divmod(flat, num_ranks)
    # experts without replicas: whole to the master, written as an [R, E - K] block
    cold = np.flatnonzero(col < 0)
    num_cold = num_ranks * cold.size
    out = np.empty((num_cold + src.size, 4), dtype=np.int64)
    block = out[:num_cold].reshape(num_ranks, cold.size, 4)
    block[:, :, 0] = np.arange(num_ranks)[:, None]
    block[:, :, 1] = cold
    block[:, :, 2] = master_rank[cold]
    np.take(load, cold, axis=1, out=block[:, :, 3], mode="clip")
    out[num_cold:, 0] = src
    out[num_cold:, 1] = c_exp[copy]
    out[num_cold:, 2] = c_rank[copy]
    out[num_cold:, 3] = take.ravel()[flat]
    return out if block[:, :, 3].all() else out[out[:, 3] > 0]


def _nth_of_group(values: np.ndarray) -> np.ndarray:
    """[N] how many earlier entries of ``values`` [N] are equal to each entry."""
    order = np.argsort(values, kind="stable")
    out = np.empty_like(order)
    out[order] = np.arange(values.size) - np.searchsorted(values[order], values[order])
    return out
