"""Rank relabeling: which rank of a DC gets which new rank's contents.

A policy whose balance does not depend on which of a DC's ranks holds which bin
(eplb, quota's per-DC rule) may hand the bins to the DC's ranks in any order that
keeps its structure. :func:`relabel_ranks` picks the order that keeps the most
copies where they already are (and masters with their optimizer state), an
assignment problem solved exactly with scipy:

- ``by_node=True``: whole nodes of a DC trade places, and ranks inside a node;
  the node assignment's costs are themselves the optimal rank assignments, so the
  two-level relabel is exact. DCs with more than :data:`NODE_RELABEL_MAX_NODES`
  nodes are relabeled rank-within-node only (``nodes^2`` small problems otherwise).
- ``by_node=False``: any rank of a DC with any other rank of the same DC.

Ranks never trade across DCs, so per-DC contents, and per-node contents with
``by_node``, are unchanged. Used by :mod:`expertmesh.planner.eplb` (a master kept
is worth its extra bytes) and :func:`expertmesh.planner.migration.align_placement`
(copies first, masters as the tie-break).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.sparse import coo_matrix, csr_matrix

from expertmesh.planner.topology import Topology

__all__ = ["NODE_RELABEL_MAX_NODES", "rank_counts", "relabel_ranks"]

NODE_RELABEL_MAX_NODES = 64


def rank_counts(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """[R, E] copies of each expert on each rank of ``phy2log`` [R, S] (-1 empty)."""
    num_ranks = phy2log.shape[0]
    r, s = np.nonzero(phy2log >= 0)
    flat = r * num_experts + phy2log[r, s]
    return np.bincount(flat, minlength=num_ranks * num_experts).reshape(num_ranks, num_experts)


def relabel_ranks(
    old_p2l: np.ndarray,
    old_master_rank: np.ndarray,
    new_p2l: np.ndarray,
    topology: Topology,
    *,
    by_node: bool = True,
    copy_weight: float = 1.0,
    master_weight: float = 0.0,
) -> np.ndarray:
    """[R] ``perm``: the contents of new rank ``i`` go to rank ``perm[i]``.

    Maximises, inside each DC, ``copy_weight`` x (copies that stay on their rank) +
    ``master_weight`` x (old masters whose rank still holds their expert), over the
    relabels the module docstring allows. ``old_master_rank`` [E] is each expert's
    master rank in ``old_p2l`` (-1: none).
    """
    num_ranks = new_p2l.shape[0]
    perm = np.arange(num_ranks)
    batches = _blocks(topology, by_node)
    if not batches:
        return perm
    block = np.full(num_ranks, -1, dtype=np.int64)  # block id of every rank
    for firsts, nodes, per_node in batches:
        size = nodes * per_node
        block[firsts[:, None] + np.arange(size)] = np.arange(firsts.size)[:, None] + block.max() + 1
    value = _sparse_value(
        old_p2l, old_master_rank, new_p2l, block, w_copy=copy_weight, w_master=master_weight
    )
    for firsts, nodes, per_node in batches:
        size = nodes * per_node
        ranks = firsts[:, None] + np.arange(size)  # [B, size]
        local = np.full(num_ranks, -1, dtype=np.int64)
        local[ranks.ravel()] = np.arange(ranks.size)
        sel = local[value.row] >= 0  # pairs inside one block by construction
        li, lj = local[value.row[sel]], local[value.col[sel]]
        dense = np.zeros((firsts.size, size, size))
        dense[li // size, li % size, lj % size] = value.data[sel]
        _solve_blocks(dense, ranks, nodes, per_node, perm)
    return perm


def _sparse_value(
    old_p2l: np.ndarray,
    old_master_rank: np.ndarray,
    new_p2l: np.ndarray,
    block: np.ndarray,
    *,
    w_copy: float,
    w_master: float,
) -> coo_matrix:
    """[R, R] sparse worth of giving new rank i's contents to rank j of the same block
    (block ids ``block`` [R], -1 never relabeled): ``w_copy`` per copy that stays
    (multiset overlap, matched as (expert, k-th copy) keys) plus ``w_master`` per old
    master of j whose expert new rank i holds."""
    num_ranks, num_slots = new_p2l.shape
    num_experts = old_master_rank.shape[0]

    def keys(p2l: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        r, s = np.nonzero((p2l >= 0) & (block >= 0)[:, None])
        e = p2l[r, s].astype(np.int64)
        order = np.lexsort((e, r))
        r, e = r[order], e[order]
        group = r * num_experts + e
        start = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
        occ = np.arange(group.size) - np.repeat(start, np.diff(np.r_[start, group.size]))
        return r, (block[r] * num_experts + e) * num_slots + occ, occ

    def matrix(rows: np.ndarray, cols: np.ndarray, width: int) -> csr_matrix:
        return csr_matrix((np.ones(rows.size), (rows, cols)), shape=(num_ranks, width))

    nr, nk, nocc = keys(new_p2l)
    orr, ok, _ = keys(old_p2l)
    width = int(block.max() + 1) * num_experts * num_slots
    inter = matrix(nr, nk, width) @ matrix(orr, ok, width).T
    first = nocc == 0  # one entry per (rank, expert held)
    me = np.flatnonzero(old_master_rank >= 0)  # -1: no old master
    me = me[block[old_master_rank[me]] >= 0]
    mr = old_master_rank[me]
    stays = (
        matrix(nr[first], nk[first] // num_slots, width)
        @ matrix(mr, block[mr] * num_experts + me, width).T
    )
    return (w_copy * inter + w_master * stays).tocoo()


def _solve_blocks(
    value: np.ndarray,
    ranks: np.ndarray,
    nodes: int,
    per_node: int,
    perm: np.ndarray,
) -> None:
    """Fill ``perm`` for a batch of same-shaped blocks from their dense worth ``value``
    [B, size, size] (new rank i on old rank j, local indices; ``ranks`` [B, size])."""
    firsts = ranks[:, 0]
    if nodes == 1:
        for b in range(firsts.size):
            rows, cols = linear_sum_assignment(value[b], maximize=True)
            perm[ranks[b, rows]] = ranks[b, cols]
        return
    # [B, a, c, i, j]: new node a's rank i on old node c's rank j
    value = value.reshape(-1, nodes, per_node, nodes, per_node).transpose(0, 1, 3, 2, 4)
    for b in range(firsts.size):
        inner = np.empty((nodes, nodes, per_node), dtype=np.int64)
        node_value = np.empty((nodes, nodes))
        for a in range(nodes):
            for c in range(nodes):
                ri, cj = linear_sum_assignment(value[b, a, c], maximize=True)
                inner[a, c, ri] = cj
                node_value[a, c] = value[b, a, c][ri, cj].sum()
        na, nc = linear_sum_assignment(node_value, maximize=True)
        for a, c in zip(na, nc, strict=True):
            perm[ranks[b, a * per_node : (a + 1) * per_node]] = (
                firsts[b] + c * per_node + inner[a, c]
            )


def _blocks(topology: Topology, by_node: bool) -> list[tuple[np.ndarray, int, int]]:
    """Same-shaped batches of blocks inside which ranks may trade: ``(first ranks [B],
    nodes, ranks per node)``; blocks of one rank are left out."""
    shapes: dict[tuple[int, int], list[int]] = {}
    start = 0
    for dc in topology.dcs:
        if not by_node:
            shapes.setdefault((1, dc.num_ranks), []).append(start)
        elif dc.nodes <= NODE_RELABEL_MAX_NODES:
            shapes.setdefault((dc.nodes, dc.ranks_per_node), []).append(start)
        else:
            firsts = range(start, start + dc.num_ranks, dc.ranks_per_node)
            shapes.setdefault((1, dc.ranks_per_node), []).extend(firsts)
        start += dc.num_ranks
    return [(np.array(f), n, p) for (n, p), f in shapes.items() if n * p > 1]
