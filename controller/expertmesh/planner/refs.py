"""Slow, obviously-correct references for the planner's fast algorithms.

One section per algorithm; tests check fast == reference on many shapes. Plain
Python loops over lists, written to be read, not to be fast.
"""

from __future__ import annotations

import numpy as np

from expertmesh.planner.plan import Placement
from expertmesh.planner.topology import Topology

__all__ = [
    "eplb_rebalance_ref",
    "even_route_ref",
    "inclusion_probabilities_ref",
    "systematic_counts_ref",
]


# ---------------------------------------------------------------------------
# eplb: DeepSeek EPLB (hierarchical and global), one layer at a time
# ---------------------------------------------------------------------------


def _f32(x: float) -> float:
    """Round to float32 (the published EPLB computes weights in float32)."""
    return float(np.float32(x))


def _ref_pack(weights: list[float], num_packs: int) -> list[tuple[int, int]]:
    """Per item ``(pack, rank_in_pack)``: heaviest item first (stable), each into the
    lightest pack that still has room (lowest pack on ties); every pack takes
    ``n / num_packs`` items. With one item per pack, item ``i`` goes to pack ``i``."""
    per_pack = len(weights) // num_packs
    if per_pack == 1:
        return [(i, 0) for i in range(len(weights))]
    load = [0.0] * num_packs
    items = [0] * num_packs
    out = [(-1, -1)] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        best = -1
        for p in range(num_packs):
            if items[p] < per_pack and (best < 0 or load[p] < load[best]):
                best = p
        out[i] = (best, items[best])
        load[best] += weights[i]
        items[best] += 1
    return out


def _ref_replicate(weights: list[float], num_phy: int) -> list[tuple[int, int]]:
    """Per physical expert ``(logical, replica rank)``: every expert once, then each
    extra copy to the expert with the largest float32 ``weight / copies`` (lowest on ties)."""
    count = [1] * len(weights)
    out = [(e, 0) for e in range(len(weights))]
    for _ in range(num_phy - len(weights)):
        best = 0
        for e in range(len(weights)):
            if _f32(weights[e] / count[e]) > _f32(weights[best] / count[best]):
                best = e
        out.append((best, count[best]))
        count[best] += 1
    return out


def eplb_rebalance_ref(
    weight: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    hierarchical: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference for :func:`expertmesh.planner.eplb.rebalance` (same arguments and results).

    For each layer: pack groups onto nodes; inside each node list its experts
    (its groups in pack order, experts of a group in order), replicate them to
    the node's physical experts, and pack those onto the node's GPUs by their
    load per copy.
    """
    num_layers, num_experts = weight.shape
    if not hierarchical:
        num_groups, num_nodes = 1, 1
    group_size = num_experts // num_groups
    phy_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes
    phy_per_gpu = num_replicas // num_gpus
    phy2log = np.full((num_layers, num_replicas), -1, dtype=np.int64)
    phyrank = np.full((num_layers, num_replicas), -1, dtype=np.int64)
    logcnt = np.zeros((num_layers, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        w = [_f32(x) for x in weight[layer].tolist()]
        group_w = [_f32(sum(w[g * group_size : (g + 1) * group_size])) for g in range(num_groups)]
        node_slots: list[list[int]] = [[] for _ in range(num_nodes)]  # groups by rank in node
        placed = _ref_pack(group_w, num_nodes)
        for node in range(num_nodes):
            ranked = sorted((r, g) for g, (n, r) in enumerate(placed) if n == node)
            node_slots[node] = [g for _, g in ranked]
        for node in range(num_nodes):
            experts = [g * group_size + j for g in node_slots[node] for j in range(group_size)]
            copies = _ref_replicate([w[e] for e in experts], phy_per_node)
            count = [sum(1 for c, _ in copies if c == i) for i in range(len(experts))]
            per_copy = [_f32(w[experts[c]] / count[c]) for c, _ in copies]
            for (local, rank), (gpu, slot) in zip(
                copies, _ref_pack(per_copy, gpus_per_node), strict=True
            ):
                p = node * phy_per_node + gpu * phy_per_gpu + slot
                phy2log[layer, p] = experts[local]
                phyrank[layer, p] = rank
            for i, e in enumerate(experts):
                logcnt[layer, e] = count[i]
    log2phy = np.full((num_layers, num_experts, int(logcnt.max())), -1, dtype=np.int64)
    for layer in range(num_layers):
        for p in range(num_replicas):
            log2phy[layer, phy2log[layer, p], phyrank[layer, p]] = p
    return phy2log, log2phy, logcnt


# ---------------------------------------------------------------------------
# traffic.even_traffic: the fractional even split, one (rank, expert) at a time
# ---------------------------------------------------------------------------


def even_route_ref(
    load: np.ndarray, placement: Placement, topology: Topology, domain: str, remote: str
) -> np.ndarray:
    """Float route [N, 4] of :func:`expertmesh.planner.traffic.even_traffic`'s split.

    For each ``(r, e)``: the copies (slots) of ``e`` in ``r``'s domain share ``load[r, e]``
    equally; with none there, every copy shares it (``spread``) or the master takes it.
    """
    key = {
        "rank": np.arange(topology.num_ranks),
        "node": topology.rank_node,
        "dc": topology.rank_dc,
        "global": np.zeros(topology.num_ranks, dtype=np.int64),
    }[domain]
    rows: list[tuple[float, float, float, float]] = []
    num_ranks, num_experts = load.shape
    mrank = placement.master_rank()
    for r in range(num_ranks):
        for e in range(num_experts):
            if load[r, e] == 0:
                continue
            copies = [
                q
                for q in range(num_ranks)
                for s in range(placement.slots_per_rank)
                if placement.phy2log[q, s] == e
            ]
            mine = [q for q in copies if key[q] == key[r]] if domain != "global" else []
            if mine:
                targets = mine
            elif remote == "master":
                targets = [int(mrank[e])]
            else:
                targets = copies
            for q in targets:
                rows.append((r, e, q, load[r, e] / len(targets)))
    return np.array(rows, dtype=np.float64).reshape(-1, 4)


# ---------------------------------------------------------------------------
# trace: inclusion probabilities and systematic top-k sampling, token by token
# ---------------------------------------------------------------------------


def inclusion_probabilities_ref(weights: np.ndarray, top_k: int) -> np.ndarray:
    """[E] ``pi = min(1, c * weights)`` with ``sum(pi) == top_k``, by repeated capping:
    scale the uncapped experts to the budget left, cap those above 1, repeat."""
    w = [float(x) for x in weights]
    capped = [False] * len(w)
    while True:
        budget = top_k - sum(capped)
        free = sum(x for x, c in zip(w, capped, strict=True) if not c)
        pi = [1.0 if c else budget * x / free for x, c in zip(w, capped, strict=True)]
        over = [i for i, p in enumerate(pi) if p > 1.0 + 1e-12 and not capped[i]]
        if not over:
            return np.array(pi)
        for i in over:
            capped[i] = True


def systematic_counts_ref(q: np.ndarray, u: np.ndarray) -> np.ndarray:
    """[R, K] tokens choosing each item under Madow's systematic design.

    ``q``: [R, K] inclusion probabilities (each < 1) of the items in each row's order,
    each row summing to an integer ``k``; ``u``: [R, n] one uniform in [0, 1) per token.
    A token takes the item ``i`` with ``C[i] <= u + j < C[i + 1]`` for each ``j < k``,
    where ``C`` is the running sum of ``q`` (``C[K] = k``).
    """
    num_rows, num_items = q.shape
    out = np.zeros((num_rows, num_items), dtype=np.int64)
    for r in range(num_rows):
        k = round(float(q[r].sum()))
        bounds = [0.0]
        for x in q[r]:
            bounds.append(bounds[-1] + float(x))
        bounds[-1] = float(k)
        for token_u in u[r]:
            for j in range(k):
                x = float(token_u) + j
                for i in range(num_items):
                    if bounds[i] <= x < bounds[i + 1]:
                        out[r, i] += 1
                        break
    return out
