"""Planning without some ranks: dead workers and DCs cut off.

A rank that died, or that sits in a DC cut off from the rest, takes no copy and no
token. The simplest sound way for every policy: the surviving ranks form the new
expert-parallel group. :func:`survivor_context` restricts a :class:`PolicyContext`
to the survivors (a smaller :class:`Topology`, loads without the absent ranks'
rows), the policy plans on it unchanged, and :func:`expand_plan` maps the plan
back onto every rank (absent ranks' slots empty, routes never name them).

The survivors' topology keeps the DCs that still have ranks, each as its surviving
ranks one per node (intra-node links are not modeled for them), and the same number of
slots per rank; masters per rank grow to ``ceil(E / survivors)`` when the survivors
need more master slots to hold every expert once.

:func:`connected_dcs` says which DCs keep training when DC pairs are cut: the
controller's DC and every DC linked to all DCs kept so far (dense gradients are
exchanged between every pair of DC leaders, so the DCs that go on must be pairwise
linked); the other DCs pause and rejoin when their links heal.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from expertmesh.planner.plan import LayerPlan, Migration, Placement
from expertmesh.planner.policy import PolicyContext
from expertmesh.planner.topology import DC, Topology

__all__ = ["connected_dcs", "expand_plan", "survivor_context"]


def live_mask(num_ranks: int, dead: tuple[int, ...] | list[int] | np.ndarray) -> np.ndarray:
    """[R] bool: True for ranks not in ``dead``. ``ValueError`` on an unknown rank or no
    survivor."""
    dead_arr = np.asarray(dead, dtype=np.int64).reshape(-1)
    if dead_arr.size and (dead_arr.min() < 0 or dead_arr.max() >= num_ranks):
        raise ValueError(f"dead ranks must be in [0, {num_ranks}), got {sorted(dead_arr)}")
    live = np.ones(num_ranks, dtype=bool)
    live[dead_arr] = False
    if not live.any():
        raise ValueError("every rank is dead; nothing can be planned")
    return live


def survivor_topology(topology: Topology, live: np.ndarray, num_experts: int) -> Topology:
    """The topology of the ``live`` [R] ranks (see the module docstring)."""
    counts = np.bincount(topology.rank_dc[live], minlength=topology.num_dcs)
    dcs = tuple(DC(d.name, int(c), 1) for d, c in zip(topology.dcs, counts, strict=True) if c)
    names = {d.name for d in dcs}
    n_live = int(live.sum())
    slots = topology.slots_per_rank
    masters = max(topology.masters_per_rank, -(-num_experts // n_live))
    if masters > slots:
        raise ValueError(
            f"{n_live} surviving ranks with {slots} slots each cannot hold {num_experts} experts"
        )
    return Topology(
        dcs=dcs,
        masters_per_rank=masters,
        spare_per_rank=slots - masters,
        intra_node=topology.intra_node,
        intra_dc=topology.intra_dc,
        inter_dc=topology.inter_dc,
        pairs={k: v for k, v in topology.pairs.items() if k[0] in names and k[1] in names},
    )


def _restrict_plan(plan: LayerPlan, live: np.ndarray) -> LayerPlan | None:
    """``plan`` on the ``live`` ranks only, or None if it has copies on absent ranks."""
    p = plan.placement
    if (p.phy2log[~live] >= 0).any():
        return None
    slots = p.slots_per_rank
    new_index = np.cumsum(live) - 1  # [R] survivor index of each live rank
    mrank = p.master // slots
    master = new_index[mrank] * slots + p.master % slots
    route = plan.route
    keep = live[route[:, 0]] & live[route[:, 2]]
    sub_route = route[keep].copy()
    sub_route[:, 0] = new_index[sub_route[:, 0]]
    sub_route[:, 2] = new_index[sub_route[:, 2]]
    return LayerPlan(
        placement=Placement(p.phy2log[live].copy(), master.astype(p.master.dtype)),
        route=sub_route,
    )


def survivor_context(ctx: PolicyContext, dead: tuple[int, ...]) -> PolicyContext:
    """``ctx`` (a :class:`PolicyContext` [R ranks]) restricted to the ranks not in ``dead``.

    The previous plan is kept when it has no copy on a dead rank (so migration stays
    minimal after a recovery); otherwise the survivors plan afresh."""
    live = live_mask(ctx.topology.num_ranks, dead)
    topo = survivor_topology(ctx.topology, live, ctx.model.num_experts)
    prev = None if ctx.previous is None else _restrict_plan(ctx.previous, live)
    if prev is not None and prev.phy2log.shape[1] != topo.slots_per_rank:
        prev = None
    return PolicyContext(
        topology=topo,
        model=ctx.model,
        step=ctx.step,
        layer=ctx.layer,
        load=ctx.load[live],
        history=np.asarray(ctx.history)[:, live],
        previous=prev,
    )


def expand_plan(plan: LayerPlan, live: np.ndarray) -> LayerPlan:
    """``plan`` made on the ``live`` [R] ranks, mapped back onto all R ranks.

    Absent ranks get empty slots; masters, routes and migrations are renumbered."""
    ranks = np.flatnonzero(live)  # [R'] full rank of each survivor
    p = plan.placement
    slots = p.slots_per_rank
    phy2log = np.full((live.size, slots), -1, dtype=p.phy2log.dtype)
    phy2log[ranks] = p.phy2log
    master = ranks[p.master // slots] * slots + p.master % slots
    route = plan.route.copy()
    if route.size:
        route[:, 0] = ranks[route[:, 0]]
        route[:, 2] = ranks[route[:, 2]]
    mig = plan.migration
    transfers = tuple(
        replace(t, src_rank=int(ranks[t.src_rank]), dst_rank=int(ranks[t.dst_rank]))
        for t in mig.transfers
    )
    return LayerPlan(
        placement=Placement(phy2log, master.astype(p.master.dtype)),
        route=route,
        migration=Migration(transfers, mig.round_seconds, mig.kept),
        solve_seconds=plan.solve_seconds,
    )


def connected_dcs(up: np.ndarray, home: int = 0) -> np.ndarray:
    """[D] bool: the DCs that keep training when links are cut.

    ``up`` [D, D] bool, symmetric: whether the link between two DCs works. ``home`` is the
    controller's DC; it always continues. DCs are added in index order when linked to every
    DC kept so far. ``ValueError`` on a non-square or asymmetric matrix."""
    up = np.asarray(up, dtype=bool)
    if up.ndim != 2 or up.shape[0] != up.shape[1]:
        raise ValueError(f"up must be [D, D], got shape {up.shape}")
    if not (up == up.T).all():
        raise ValueError("up must be symmetric (a cut cuts both directions)")
    d = up.shape[0]
    if not 0 <= home < d:
        raise ValueError(f"home DC {home} is not in [0, {d})")
    keep = np.zeros(d, dtype=bool)
    keep[home] = True
    for b in range(d):
        if not keep[b] and up[b, keep].all():
            keep[b] = True
    return keep
