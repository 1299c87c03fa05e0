"""Shared token routing: split each ``load[r, e]`` among the copies of ``e``.

Policies that do not route by quota (``static``, ``eplb``, ``fastermoe``) use
:func:`route_even`: tokens of ``(r, e)`` go evenly to the copies of ``e`` in
``r``'s domain when that domain holds any, else evenly to all copies; the
remainder goes one token each to copies picked round-robin from ``r``, so no
copy is favoured across sources.
"""

from __future__ import annotations

import numpy as np

from expertmesh.planner.plan import Placement

__all__ = ["route_even"]


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
