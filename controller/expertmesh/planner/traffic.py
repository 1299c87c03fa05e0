"""Token traffic of one layer at one step, aggregated for the cost model.

:class:`TokenTraffic` (:mod:`expertmesh.planner.trafficbase`) holds, per rank, the top-k
assignments it computes, sends and receives over each fabric, and per ordered DC pair
the assignments that cross. Its builders:

- :func:`traffic_from_route`: exact, from route rows ``[N, 4]``.
- :func:`even_traffic`, :func:`even_traffic_steps`: the even split, without route rows
  (:mod:`expertmesh.planner.evensplit`, re-exported here).
- :func:`weighted_traffic`, :func:`quota_traffic`: quota's split (each copy keeps its own
  rank's tokens, then takes a share of what is left), without route rows.

Shells: traffic between a rank and a destination is classed by how far apart
they are: 0 same rank, 1 same node, 2 same DC (other node), 3 other DC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from expertmesh.planner.evensplit import even_traffic, even_traffic_steps
from expertmesh.planner.topology import Topology
from expertmesh.planner.trafficbase import (
    _EXACT,
    Domain,
    TokenTraffic,
    _dc_tokens,
    _node_is_dc,
    _pairs,
    _shell_sums,
    _whole_runs,
    level_sums,
)

if TYPE_CHECKING:
    from expertmesh.planner.quota import QuotaSolution

__all__ = [
    "Domain",
    "TokenTraffic",
    "even_traffic",
    "even_traffic_steps",
    "level_sums",
    "quota_traffic",
    "traffic_from_route",
    "weighted_traffic",
]


def traffic_from_route(
    route: np.ndarray, load: np.ndarray, topology: Topology, top_k: int
) -> TokenTraffic:
    """Exact :class:`TokenTraffic` of ``route`` [N, 4] ``(src_rank, expert, dst_rank, tokens)``.

    ``load`` [R, E] is the load the route carries (only its per-DC token totals are used).
    """
    if route.ndim != 2 or route.shape[1] != 4:
        raise ValueError(f"route must be [N, 4], got {route.shape}")
    if top_k < 1:
        raise ValueError("top_k must be >= 1")
    num_ranks, num_dcs = topology.num_ranks, topology.num_dcs
    src, dst = route[:, 0].astype(np.int64), route[:, 2].astype(np.int64)
    tok = route[:, 3].astype(np.float64)
    shell = np.asarray(topology.link_class(src, dst))  # LinkClass: 0 same rank .. 3 other DC
    rank_tokens = np.bincount(dst, weights=tok, minlength=num_ranks)
    rank_out = np.zeros((num_ranks, 3))
    rank_in = np.zeros((num_ranks, 3))
    for j in (1, 2, 3):
        m = shell == j
        rank_out[:, j - 1] = np.bincount(src[m], weights=tok[m], minlength=num_ranks)
        rank_in[:, j - 1] = np.bincount(dst[m], weights=tok[m], minlength=num_ranks)
    m = shell == 3
    key = topology.rank_dc[src[m]] * num_dcs + topology.rank_dc[dst[m]]
    dense = np.bincount(key, weights=tok[m], minlength=num_dcs * num_dcs).reshape(num_dcs, num_dcs)
    ps, pd, pt = _pairs(dense)
    return TokenTraffic(
        rank_tokens, rank_out, rank_in, ps, pd, pt, _dc_tokens(load, topology, top_k)
    )


def _sorted_unique(values: np.ndarray, space: int) -> np.ndarray:
    """``np.unique(values)`` for int ``values`` in ``[0, space)``: a dense table when the
    space is small (4M), a sort otherwise."""
    if space > 4_000_000:
        return np.unique(values)
    present = np.zeros(space, bool)
    present[values] = True
    return np.flatnonzero(present)


def weighted_traffic(
    load: np.ndarray,
    left: np.ndarray,
    copies: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    topology: Topology,
    top_k: int,
) -> TokenTraffic:
    """:class:`TokenTraffic` of a split where copy ``c`` of expert ``e`` first keeps
    ``own[c]`` tokens of its own rank, then takes the share ``weight[c]`` of what every
    source still has (``left`` [R, E]); the weights of one expert's copies sum to 1.

    ``load`` [R, E] is the whole load (for per-DC token counts); ``copies`` is
    ``(rank, expert, weight, own)``, each [C]. ``O(R E + D^2 E)``, no route rows.
    """
    c_rank, c_exp, c_w, c_own = copies
    num_ranks, num_experts = left.shape
    group = [np.arange(num_ranks), topology.rank_node, topology.rank_dc]
    sizes = [num_ranks, topology.num_nodes, topology.num_dcs]
    # qg[j]: [C] the rank, node, DC (and everything) of each copy
    qg = [c_rank.astype(np.int64, copy=False), topology.rank_node[c_rank],
          topology.rank_dc[c_rank], np.zeros(c_rank.size, np.int64)]  # fmt: skip
    # g[j]: [groups at level j, E] weight of the copies in each rank, node, DC
    same = _node_is_dc(topology)  # one node a DC: the DC level repeats the node level
    g: list[np.ndarray] = []
    for j in range(3):
        if j == 2 and same:
            g.append(g[1])
            continue
        g.append(
            np.bincount(qg[j] * num_experts + c_exp, weights=c_w,
                        minlength=sizes[j] * num_experts).reshape(sizes[j], num_experts)
        )  # fmt: skip
    g_all = np.bincount(c_exp, weights=c_w, minlength=num_experts)  # [E]
    # g[0] is already by rank (a gather by every rank in order would copy it)
    reach = [np.einsum("re,re->r", left, g[0]), np.einsum("re,re->r", left, g[1][group[1]])]
    reach.append(reach[1] if same else np.einsum("re,re->r", left, g[2][group[2]]))
    reach.append(left @ g_all)
    rank_out = np.stack([reach[j] - reach[j - 1] for j in (1, 2, 3)], axis=1)
    lsum = level_sums(left, topology)
    at = [lsum[j][qg[j], c_exp] for j in range(4)]  # [C] each: what reaches each level
    in_shell = np.stack([at[j] - (at[j - 1] if j else 0.0) for j in range(4)], axis=1)
    in_shell *= c_w[:, None]
    in_shell[:, 0] += c_own
    rank_tokens = np.bincount(c_rank, weights=in_shell.sum(axis=1), minlength=num_ranks)
    rank_in = _shell_sums(c_rank, in_shell, num_ranks)
    dense = lsum[2] @ g[2].T  # [D, D] what sources of DC s send to copies in DC x
    ps, pd, pt = _pairs(dense)
    return TokenTraffic(
        rank_tokens, rank_out, rank_in, ps, pd, pt, _dc_tokens(load, topology, top_k)
    )


def quota_traffic(
    load: np.ndarray, solution: QuotaSolution, topology: Topology, top_k: int
) -> TokenTraffic:
    """The cost model's view of ``solution``'s route, without its [N, 4] rows.

    The route rule of :mod:`expertmesh.planner.quota` in fractions instead of whole tokens: each
    copy keeps what it can of its own rank's tokens, then replicas take their amount in
    proportion to what every source has left (which stays proportional to what it had
    after the own-rank step), and the master the rest. Equal to
    ``traffic_from_route(solution.route, ...)`` up to the largest-remainder rounding;
    ``O(R E + D^2 E)`` instead of the route's ``O(R x copies)`` rows.
    """
    num_experts = load.shape[1]
    rep_expert, rep_rank, rep_tokens = solution.replicas
    master_rank = solution.placement.master_rank()
    rep_sum = np.bincount(rep_expert, weights=rep_tokens, minlength=num_experts)
    c_exp = np.concatenate([rep_expert, np.arange(num_experts)])
    c_rank = np.concatenate([rep_rank, master_rank])
    hot = np.zeros(num_experts, bool)
    hot[rep_expert] = True
    runs = _whole_runs(topology)
    if runs is not None and load.dtype.kind in "iu" and rep_tokens.dtype.kind in "iu":
        got = _quota_whole(load, (c_rank, c_exp, rep_tokens, rep_sum, hot), topology, top_k, runs)
        if got is not None:
            return got
    demand = load.sum(axis=0)
    need = np.concatenate([rep_tokens, demand - rep_sum]).astype(np.float64)
    left = load.astype(np.float64)
    # own rank first, for every copy of an expert with replicas (a cold master takes all)
    own = np.where(hot[c_exp], np.minimum(need, left[c_rank, c_exp]), 0.0)
    np.subtract.at(left, (c_rank, c_exp), own)
    rest = left.sum(axis=0)  # [E]
    weight = (need - own) / np.where(rest > 0, rest, 1.0)[c_exp]
    return weighted_traffic(load, left, (c_rank, c_exp, weight, own), topology, top_k)


#: [3, 1] the shells 1, 2, 3 as offsets of (rank, shell) bins
_SHELL_COL = np.arange(3).reshape(3, 1)


def _quota_whole(
    load: np.ndarray,
    copies: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    topology: Topology,
    top_k: int,
    runs: tuple[int, int],
) -> TokenTraffic | None:
    """:func:`quota_traffic` of an integer load and whole replica tokens on a topology of
    :func:`_whole_runs` ``runs``: :func:`weighted_traffic` of the same copies, the same
    floats, in fewer array operations; ``None`` when the load's total reaches 2**53.

    What sources have, and have left, is whole tokens, so its sums (by node, DC, expert)
    are exact in any order: reshaped sums of the load, less what copies keep. The weighted
    sums (the copies' weights are fractions) are :func:`weighted_traffic`'s, the same calls
    on the same arrays; what copies take by shell is its [C, 4] array, filled column by
    column, and summed by (rank, shell) over a [3, C] copy (each bin adds its copies in
    the same order: the same floats)."""
    c_rank, c_exp, rep_tokens, rep_sum, hot = copies
    num_ranks, num_experts = load.shape
    num_nodes, num_dcs = topology.num_nodes, topology.num_dcs
    per_node, per_dc = runs
    left = load.astype(np.float64)
    node = left.reshape(num_nodes, per_node, num_experts).sum(axis=1)  # of the load so far
    demand = node.sum(axis=0)  # [E] load.sum(axis=0)
    if not float(demand.sum()) < _EXACT:  # (non-negative counts: a sum is exact below)
        return None
    dc = node.reshape(num_dcs, per_dc, num_experts).sum(axis=1) if per_dc else node
    dc_sums = dc.sum(axis=1)  # [D] assignments from each DC
    need = np.concatenate([rep_tokens, demand - rep_sum])
    flat = left.reshape(-1)  # a view: writes go to left
    cell = c_rank * num_experts + c_exp
    # own rank first, for every copy of an expert with replicas (a cold master takes all)
    own = np.where(hot[c_exp], np.minimum(need, flat[cell]), 0.0)
    np.subtract.at(flat, cell, own)
    c_node = topology.rank_node[c_rank]
    node_cell = c_node * num_experts + c_exp
    np.subtract.at(node.reshape(-1), node_cell, own)  # node sums of what is left
    dc_cell = node_cell
    if per_dc:
        dc_cell = topology.rank_dc[c_rank] * num_experts + c_exp
        np.subtract.at(dc.reshape(-1), dc_cell, own)
    rest = demand - np.bincount(c_exp, weights=own, minlength=num_experts)  # left.sum(axis=0)
    c_w = (need - own) / np.where(rest > 0, rest, 1.0)[c_exp]
    # what reaches each copy's rank, node, DC, everything: weighted_traffic's at[j]
    at_rank, at_node = flat[cell], node.reshape(-1)[node_cell]
    at_dc = dc.reshape(-1)[dc_cell] if per_dc else at_node  # one node a DC: the same sums
    by_shell = np.empty((4, cell.size))  # weighted_traffic's in_shell, transposed
    np.multiply(at_rank, c_w, out=by_shell[0])
    by_shell[0] += own
    np.subtract(at_node, at_rank, out=by_shell[1])
    np.subtract(at_dc, at_node, out=by_shell[2])
    np.subtract(rest[c_exp], at_dc, out=by_shell[3])
    by_shell[1:] *= c_w
    in_shell = np.ascontiguousarray(by_shell.T)  # [C, 4]
    # weight of the copies in each rank, node, DC and everywhere
    g0 = np.bincount(cell, weights=c_w, minlength=num_ranks * num_experts)
    g1 = np.bincount(node_cell, weights=c_w, minlength=num_nodes * num_experts)
    g1 = g1.reshape(num_nodes, num_experts)
    g2 = g1
    if per_dc:
        g2 = np.bincount(dc_cell, weights=c_w, minlength=num_dcs * num_experts)
        g2 = g2.reshape(num_dcs, num_experts)
    g_all = np.bincount(c_exp, weights=c_w, minlength=num_experts)
    reach0 = np.einsum("re,re->r", left, g0.reshape(num_ranks, num_experts))
    # each rank's row against its node's (DC's) weights, over a [groups, ranks, E] view: the
    # same sum of E products a row as einsum("re,re->r", left, g1[rank_node]), no gather
    by_node = left.reshape(num_nodes, per_node, num_experts)
    reach1 = np.einsum("nre,ne->nr", by_node, g1).reshape(num_ranks)
    reach2 = reach1
    if per_dc:
        by_dc = left.reshape(num_dcs, per_node * per_dc, num_experts)
        reach2 = np.einsum("dre,de->dr", by_dc, g2).reshape(num_ranks)
    rank_out = np.empty((num_ranks, 3))
    np.subtract(reach1, reach0, out=rank_out[:, 0])
    np.subtract(reach2, reach1, out=rank_out[:, 1])
    np.subtract(left @ g_all, reach2, out=rank_out[:, 2])
    rank_tokens = np.bincount(c_rank, weights=in_shell.sum(axis=1), minlength=num_ranks)
    key = c_rank * 3 + _SHELL_COL  # [3, C] (rank, shell) bins of shells 1, 2, 3
    rank_in = np.bincount(key.ravel(), weights=by_shell[1:].ravel(), minlength=3 * num_ranks)
    dense = dc @ g2.T  # [D, D] what sources of DC s send to copies in DC x
    ps, pd, pt = _pairs(dense)
    return TokenTraffic(
        rank_tokens, rank_out, rank_in.reshape(num_ranks, 3), ps, pd, pt,
        _dc_tokens(load, topology, top_k, dc_sums),
    )  # fmt: skip
