"""``eplb``: DeepSeek's expert-parallelism load balancer (EPLB), reimplemented in numpy.

The published algorithm (DeepSeek EPLB README, DeepSeek-V3 report) replicates
heavy experts and packs the copies onto GPUs from an *estimate* of expert load,
a sum over a history window, and is re-run every ``period`` steps. Two policies:

- **hierarchical** (when the number of nodes divides the number of expert
  groups): pack expert groups onto nodes so node loads are balanced; replicate
  experts inside each node; pack each node's physical experts onto its GPUs.
- **global**: the same with one group and one node: replicate experts globally,
  pack all physical experts onto GPUs.

Building blocks, each reimplemented from that description:

- *replicate*: give the next copy to the expert with the largest load per copy,
  ``w[e] / logcnt[e]``, until every physical slot is used. The sequence of picks
  is the descending merge of ``w[e] / c`` for ``c = 1, 2, ...`` (D'Hondt
  apportionment), so it is computed with one sort instead of a loop.
- *balanced packing*: items heaviest first, each to the lightest pack that is
  not full; every pack gets exactly ``n / m`` items. Greedy and sequential in
  the items; vectorized over rows (layers x nodes) for many rows, a heap per row
  for few rows.

Numerics and ties follow the published implementation so its outputs are
reproduced: weights are rounded to float32, item weights are float32
``w / logcnt``, pack loads accumulate in float64; sorts are stable (heavier
first, lower index first on ties); the lightest pack is the lowest-numbered on
ties. (The published code sorts with an unstable sort, so on inputs with ties
between different experts its placement may differ from ours in which of the
tied items goes where.)

The policy adds what DeepSeek's deployments leave out: between re-plans the
placement stays as it is, each re-plan relabels nodes and ranks (inside a DC,
keeping the hierarchical structure) to keep as many copies where they already
are, and masters stay on their rank when it still holds the expert.
"""

from __future__ import annotations

import heapq
from typing import Literal, cast

import numpy as np
from pydantic import Field

from expertmesh.planner.plan import Placement
from expertmesh.planner.policy import Policy, PolicyContext, PolicySettings, register
from expertmesh.planner.relabel import relabel_ranks
from expertmesh.planner.routing import route_even
from expertmesh.planner.topology import Topology

__all__ = ["EplbPolicy", "rebalance"]

# Below this many rows, packing runs a heap per row (numpy's per-call overhead
# dominates); at and above it, one numpy loop over items serves all rows at once.
_VECTOR_ROWS = 32


def rebalance(
    weight: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    hierarchical: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek EPLB's ``rebalance_experts``: replicate and place experts of every layer.

    Args:
        weight: [L, E] non-negative estimated load of each logical expert per layer.
        num_replicas: physical experts per layer (``P``); a multiple of ``num_gpus``, ``>= E``.
        num_groups: expert groups (``E`` divisible by it); used by the hierarchical policy.
        num_nodes: server nodes; divides ``num_groups`` and ``num_gpus`` when hierarchical.
        num_gpus: GPUs (ranks); physical expert ``p`` lives on GPU ``p // (P / num_gpus)``,
            GPUs ``[k * G/N, (k+1) * G/N)`` on node ``k``.
        hierarchical: the hierarchical policy (else global: one group, one node).

    Returns:
        phy2log: [L, P] int64 logical expert of each physical expert.
        log2phy: [L, E, X] int64 physical experts of each logical expert, by replica
            rank, ``-1`` padded (``X`` is the largest copy count).
        logcnt: [L, E] int64 copies of each logical expert (sums to ``P`` per layer).
    """
    phy2log, phyrank, logcnt = _rebalance(
        weight, num_replicas, num_groups, num_nodes, num_gpus, hierarchical=hierarchical
    )
    num_layers, num_experts = logcnt.shape
    log2phy = np.full((num_layers, num_experts, int(logcnt.max())), -1, dtype=np.int64)
    layer = np.repeat(np.arange(num_layers), num_replicas)
    log2phy[layer, phy2log.ravel(), phyrank.ravel()] = np.tile(np.arange(num_replicas), num_layers)
    return phy2log, log2phy, logcnt


def _rebalance(
    weight: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    hierarchical: bool,
    vector_rows: int = _VECTOR_ROWS,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`rebalance` returning ``(phy2log [L, P], phyrank [L, P], logcnt [L, E])``.

    ``phyrank[l, p]`` is the replica rank of physical expert ``p`` (0 for the
    first copy of its logical expert).
    """
    w = _check_weight(weight)
    if not hierarchical:
        num_groups, num_nodes = 1, 1
    num_layers, num_experts = w.shape
    _check_sizes(num_experts, num_replicas, num_groups, num_nodes, num_gpus)
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    log_per_node = num_experts // num_nodes
    phy_per_node = num_replicas // num_nodes
    phy_per_gpu = num_replicas // num_gpus

    # 1. groups -> nodes. mlog: logical experts renumbered node by node.
    group_w = w.reshape(num_layers, num_groups, group_size).sum(-1, dtype=np.float64)
    gpack, grank = _pack(group_w.astype(np.float32), num_nodes, vector_rows)  # [L, G]
    log2mlog = (
        ((gpack * groups_per_node + grank) * group_size)[:, :, None] + np.arange(group_size)
    ).reshape(num_layers, num_experts)
    mlog2log = _inverse(log2mlog)

    # 2. replicate inside each node: rows are (layer, node).
    mlog_w = np.take_along_axis(w, mlog2log, 1).reshape(-1, log_per_node)  # [L*N, E/N]
    phy2mlog, phyrank, mlogcnt = _replicate(mlog_w, phy_per_node)  # [L*N, P/N], .., [L*N, E/N]

    # 3. each node's physical experts -> its GPUs.
    per_copy = mlog_w / mlogcnt.astype(np.float32)  # float32 [L*N, E/N]
    phy_w = np.take_along_axis(per_copy, phy2mlog, 1)  # [L*N, P/N]
    pack, rank_in_pack = _pack(phy_w, num_gpus // num_nodes, vector_rows)
    pphy2phy = _inverse(pack * phy_per_gpu + rank_in_pack)  # slot in node -> phy in node

    node_base = (np.arange(num_nodes) * log_per_node)[None, :, None]
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, 1).reshape(num_layers, num_nodes, -1)
    pphy2mlog = (pphy2mlog + node_base).reshape(num_layers, num_replicas)  # [L, P]
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, 1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, 1).reshape(num_layers, num_replicas)
    logcnt = np.take_along_axis(mlogcnt.reshape(num_layers, num_experts), log2mlog, 1)
    return phy2log, pphyrank, logcnt


def _check_weight(weight: np.ndarray) -> np.ndarray:
    w = np.asarray(weight)
    if w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"weight must be a non-empty [L, E] array, got shape {w.shape}")
    if w.dtype.kind not in "iuf":
        raise ValueError(f"weight must be numeric, got dtype {w.dtype}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("weight must be finite and non-negative")
    # weights are rounded to float32 (as the published code does) and summed per group and
    # node: a layer's total must stay a finite float32, or inf / nan reach the packing
    top = float(w.astype(np.float64).sum(axis=1).max())
    if top > float(np.finfo(np.float32).max):
        raise ValueError(
            f"weight: a layer sums to {top:.3g}, beyond float32's {np.finfo(np.float32).max:.3g} "
            "(EPLB computes in float32); scale the weights down"
        )
    return w.astype(np.float32)


def _check_sizes(
    num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> None:
    if min(num_replicas, num_groups, num_nodes, num_gpus) < 1:
        raise ValueError("num_replicas, num_groups, num_nodes and num_gpus must be >= 1")
    if num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not split into {num_groups} groups")
    if num_groups % num_nodes:
        raise ValueError(f"{num_groups} groups do not split over {num_nodes} nodes")
    if num_gpus % num_nodes:
        raise ValueError(f"{num_gpus} GPUs do not split over {num_nodes} nodes")
    if num_replicas % num_gpus:
        raise ValueError(f"{num_replicas} replicas do not split over {num_gpus} GPUs")
    if num_replicas < num_experts:
        raise ValueError(f"{num_replicas} replicas cannot hold {num_experts} experts")


def _inverse(perm: np.ndarray) -> np.ndarray:
    """[X, n] row-wise inverse of permutations ``perm`` [X, n]."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), 1)
    return inv


def _replicate(w: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate ``n`` experts into ``num_phy`` copies, greedily by load per copy.

    ``w``: [X, n] float32 loads. Returns ``phy2log`` [X, num_phy] (the first ``n``
    are the experts themselves, then the extra copies in pick order), ``rank``
    [X, num_phy] replica rank of each copy, ``logcnt`` [X, n].

    The ``j``-th extra copy goes to the expert maximising ``w[e] / logcnt[e]``
    (lowest ``e`` on ties). That order is the descending merge of the candidates
    ``(e, c)`` with value ``w[e] / c``, ``c >= 1``; expert ``e`` can win at most
    ``w[e] * num_phy / sum(w)`` of them (the last pick's value is at least
    ``sum(w) / num_phy``), which bounds how many candidates are enumerated.
    """
    rows, n = w.shape
    extra = num_phy - n
    phy2log = np.empty((rows, num_phy), dtype=np.int64)
    rank = np.zeros((rows, num_phy), dtype=np.int64)
    phy2log[:, :n] = np.arange(n)
    if extra == 0:
        return phy2log, rank, np.ones((rows, n), dtype=np.int64)
    total = w.sum(1, dtype=np.float64)[:, None]  # [X, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = np.floor(w * (num_phy / total)) + 2  # +2: slack for float rounding
    ncand = np.where(total > 0, np.minimum(bound, extra), extra).astype(np.int64).ravel()
    owner = np.repeat(np.arange(rows * n), ncand)  # flat (row, expert) of each candidate
    c = np.arange(owner.size) - np.repeat(np.cumsum(ncand) - ncand, ncand) + 1  # 1..ncand
    value = w.ravel()[owner] / c.astype(np.float32)  # float32, as the published code
    row = owner // n
    order = np.lexsort((c, owner, -value, row))  # by row, value desc, expert, copy
    per_row = np.bincount(row, minlength=rows)
    start = np.cumsum(per_row) - per_row
    take = order[(start[:, None] + np.arange(extra)).ravel()]  # [X*extra] first picks
    phy2log[:, n:] = (owner[take] % n).reshape(rows, extra)
    rank[:, n:] = c[take].reshape(rows, extra)
    logcnt = np.bincount(
        (np.repeat(np.arange(rows), num_phy) * n + phy2log.ravel()), minlength=rows * n
    ).reshape(rows, n)
    return phy2log, rank, logcnt


def _pack(w: np.ndarray, num_packs: int, vector_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Balanced packing of ``n`` items into ``num_packs`` packs of ``n / num_packs`` items.

    ``w``: [X, n] float32 item weights. Items heaviest first (stable), each to the
    lightest pack that is not full (lowest pack on ties). With one item per pack
    item ``i`` goes to pack ``i``. Returns ``pack`` [X, n] and ``rank_in_pack`` [X, n].
    """
    rows, n = w.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return np.broadcast_to(np.arange(n), (rows, n)).copy(), np.zeros((rows, n), np.int64)
    order = np.argsort(-w, axis=1, kind="stable")  # [X, n] heaviest first
    ws = np.take_along_axis(w, order, 1).astype(np.float64)
    if rows >= vector_rows:
        pack_s, rank_s = _pack_sorted_rows(ws, num_packs, per_pack)
    else:
        pack_s, rank_s = _pack_sorted_heap(ws, num_packs, per_pack)
    pack = np.empty_like(pack_s)
    rank = np.empty_like(rank_s)
    np.put_along_axis(pack, order, pack_s, 1)
    np.put_along_axis(rank, order, rank_s, 1)
    return pack, rank


def _pack_sorted_rows(
    ws: np.ndarray, num_packs: int, per_pack: int
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing of sorted items ``ws`` [X, n], one numpy step per item for all rows."""
    rows, n = ws.shape
    r = np.arange(rows)
    load = np.zeros((rows, num_packs))  # full packs are set to +inf
    count = np.zeros((rows, num_packs), dtype=np.int64)
    pack = np.empty((rows, n), dtype=np.int64)
    rank = np.empty((rows, n), dtype=np.int64)
    for j in range(n):
        p = load.argmin(1)
        k = count[r, p]
        pack[:, j], rank[:, j] = p, k
        count[r, p] = k + 1
        load[r, p] += ws[:, j]
        full = k + 1 == per_pack
        load[r[full], p[full]] = np.inf
    return pack, rank


def _pack_sorted_heap(
    ws: np.ndarray, num_packs: int, per_pack: int
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing of sorted items ``ws`` [X, n] with a heap of (load, pack) per row."""
    rows, n = ws.shape
    pack = np.empty((rows, n), dtype=np.int64)
    rank = np.empty((rows, n), dtype=np.int64)
    for i in range(rows):
        heap = [(0.0, p, 0) for p in range(num_packs)]  # (load, pack, items): a valid heap
        pk, rk = [0] * n, [0] * n
        for j, x in enumerate(ws[i].tolist()):
            load, p, k = heap[0]  # the lightest pack (keys differ: p is unique)
            pk[j], rk[j] = p, k
            if k + 1 < per_pack:  # pop it and push it back heavier, in one sift
                heapq.heapreplace(heap, (load + x, p, k + 1))
            else:
                heapq.heappop(heap)
        pack[i], rank[i] = pk, rk
    return pack, rank


# ---------------------------------------------------------------------------
# The policy
# ---------------------------------------------------------------------------


class EplbSettings(PolicySettings):
    """Settings of :class:`EplbPolicy` (DeepSeek EPLB run periodically on a load window)."""

    period: int = Field(
        default=10,
        ge=1,
        le=10_000_000,
        description="re-plan at steps 0, 1, period, 2*period, ... (step 0 has no history "
        "and places blindly; step 1 replaces that as soon as one microbatch is known); "
        "deployments run EPLB every ~1000-3000 iterations, short traces need less",
    )
    window: int = Field(
        default=10,
        ge=1,
        le=1_000_000,
        description="history microbatches summed into the per-expert load estimate",
    )
    num_groups: int = Field(
        default=1,
        ge=1,
        le=65_536,
        description="expert groups of the model's group-limited routing (divides the expert "
        "count); 1 for a model without groups, as vLLM and SGLang pass it, which makes "
        "`auto` choose the global policy on several nodes",
    )
    min_gain: float = Field(
        default=0.05,
        ge=0.0,
        le=10.0,
        description="at a re-plan, keep the running placement unless the new one lowers the "
        "window's expected max/mean by more than this fraction (0: always re-place, as "
        "DeepSeek's EPLB does); under slow drift this skips migrations that buy nothing",
    )
    hierarchical: Literal["auto"] | bool = Field(
        default="auto",
        description="hierarchical policy (groups to nodes, replicate in nodes, copies to "
        "ranks) or global; auto: hierarchical when the nodes divide the groups and "
        "every node has as many ranks",
    )


@register
class EplbPolicy(Policy):
    """DeepSeek EPLB on ``ctx.history`` every ``period`` steps, unchanged in between.

    Maps EPLB onto the topology with ``num_gpus = R``, ``num_nodes`` = the
    topology's nodes and ``num_replicas = R * S`` (every slot filled). Tokens go
    evenly to the copies in their own DC when it holds one.

    The default is one expert group, so the global policy on several nodes. With
    as many groups as nodes, step 1 of the hierarchical policy has nothing to
    balance (group ``k`` simply lands on node ``k``) and node loads stay as
    skewed as the experts' order makes them; set ``num_groups`` to the model's
    groups when routing is group-limited.

    ``relabel_ranks`` stays ``False``: balance does not depend on which rank of a
    DC gets which bin, but it does depend on the DC (routing stays inside DCs),
    and the hierarchical policy needs a node's bins to stay on one node. The
    policy relabels nodes and ranks itself within those limits.
    """

    name = "eplb"
    Settings = EplbSettings
    relabel_ranks = False

    @property
    def cfg(self) -> EplbSettings:
        """The settings, typed (``make_policy`` validated them as :class:`EplbSettings`)."""
        return cast(EplbSettings, self.settings)

    def history_window(self) -> int:
        return self.cfg.window

    def resolve(self, topology: Topology, num_experts: int) -> tuple[int, bool]:
        """``(num_groups, hierarchical)`` this policy uses on ``topology``; ``ValueError``
        if the settings do not fit it."""
        s = self.cfg
        nodes = topology.num_nodes
        groups = s.num_groups
        if num_experts % groups:
            raise ValueError(f"eplb: {num_experts} experts do not split into {groups} groups")
        uniform = len({d.ranks_per_node for d in topology.dcs}) == 1
        fits = uniform and groups % nodes == 0
        if s.hierarchical == "auto":
            return groups, fits
        if s.hierarchical and not fits:
            raise ValueError(
                f"eplb: hierarchical needs the {nodes} nodes to divide the {groups} groups "
                "and the same ranks on every node"
            )
        return groups, bool(s.hierarchical)

    def replans_at(self, step: int) -> bool:
        """Whether :meth:`place` re-plans at ``step``: steps 0 and 1, then every ``period``.

        Step 0 has no history and spreads copies blindly; deployments start from
        recorded statistics instead (SGLang's ``--init-expert-location``), which the
        re-plan at step 1, on the first microbatch seen, stands in for.
        """
        return step == 1 or step % self.cfg.period == 0

    def place(self, ctx: PolicyContext) -> Placement:
        prev = ctx.previous
        if prev is not None and not self.replans_at(ctx.step):
            return prev.placement
        topo = ctx.topology
        num_experts = ctx.model.num_experts
        groups, hier = self.resolve(topo, num_experts)
        weight = ctx.history.sum(axis=(0, 1)) if ctx.history.size else np.zeros(num_experts)
        if not weight.any():
            weight = np.ones(num_experts)  # nothing seen yet: spread copies evenly
        num_ranks, slots = topo.num_ranks, topo.slots_per_rank
        phy2log, _, _ = _rebalance(
            weight[None, :], num_ranks * slots, groups, topo.num_nodes, num_ranks, hierarchical=hier
        )
        new = phy2log[0].reshape(num_ranks, slots)
        if prev is not None and self.cfg.min_gain > 0:
            keep = expected_imbalance(prev.placement.phy2log, weight)
            if keep <= expected_imbalance(new, weight) * (1 + self.cfg.min_gain):
                return prev.placement
        if prev is not None:
            model = ctx.model
            extra = (model.master_bytes - model.expert_bytes) / model.expert_bytes
            perm = relabel_ranks(  # inside DCs only, keeping nodes whole if hierarchical
                prev.placement.phy2log, prev.placement.master_rank(), new, topo,
                by_node=hier, master_weight=extra,
            )  # fmt: skip
            moved = np.empty_like(new)
            moved[perm] = new
            new = moved
        old_master = prev.placement.master_rank() if prev is not None else None
        return Placement(phy2log=new.astype(np.int32), master=_masters(new, old_master))

    def route(self, ctx: PolicyContext, placement: Placement) -> np.ndarray:
        return route_even(ctx.load, placement, ctx.topology.rank_dc)


def expected_imbalance(phy2log: np.ndarray, weight: np.ndarray) -> float:
    """max/mean tokens per rank when each expert's ``weight`` [E] splits evenly over its
    copies in ``phy2log`` [R, S] (-1 empty)."""
    held = phy2log >= 0
    cnt = np.bincount(phy2log[held], minlength=weight.shape[0])
    per_slot = np.zeros(phy2log.shape)
    per_slot[held] = weight[phy2log[held]] / cnt[phy2log[held]]
    per_rank = per_slot.sum(axis=1)
    mean = per_rank.mean()
    return float(per_rank.max() / mean) if mean > 0 else 1.0


def _masters(phy2log: np.ndarray, old_master_rank: np.ndarray | None) -> np.ndarray:
    """[E] flat master slot per expert: on its old master's rank if that rank still
    holds it, else its first copy (lowest flat slot)."""
    num_ranks, slots = phy2log.shape
    flat = phy2log.ravel()
    experts, first = np.unique(flat, return_index=True)
    keep = first[experts >= 0].astype(np.int64)  # [E]
    if old_master_rank is None:
        return keep
    num_experts = keep.size
    first_on_rank = np.full((num_ranks, num_experts), -1, dtype=np.int64)
    for s in range(slots - 1, -1, -1):  # lowest slot wins
        r = np.flatnonzero(phy2log[:, s] >= 0)
        first_on_rank[r, phy2log[r, s]] = r * slots + s
    stay = first_on_rank[old_master_rank, np.arange(num_experts)]
    return np.where(stay >= 0, stay, keep)
