"""``fastermoe``: FasterMoE's dynamic shadowing, the classic baseline for cross-DC EP.

FasterMoE (He et al., PPoPP 2022) keeps expert parallelism's placement and,
every iteration after the gate has run, *shadows* the hottest experts: their
weights are broadcast to every rank, each rank computes its own tokens for
them, and their gradients are reduced back to the owner. It shadows the
hottest experts one by one while its performance model says the iteration
gets faster. Here that model is :func:`~expertmesh.planner.costmodel.placement_cost`,
the same one ``hybrid`` and the simulator use, so the comparison is fair.

Masters never move (static EP's placement). A shadow needs a free slot on every
rank, so the number of shadows is bounded by the fewest free slots of any rank.
"""

from __future__ import annotations

from typing import ClassVar, cast

import numpy as np
from pydantic import Field

from expertmesh.planner.costmodel import CostSettings, placement_cost
from expertmesh.planner.plan import Placement
from expertmesh.planner.policy import Policy, PolicyContext, PolicySettings, register
from expertmesh.planner.routing import route_even
from expertmesh.planner.static import static_placement

__all__ = ["FasterMoEPolicy", "shadow"]


def shadow(masters: Placement, experts: np.ndarray) -> Placement:
    """``masters`` with each of ``experts`` [j] copied to every rank but its master's.

    ``masters``: a placement whose slots hold masters only. Rank ``r`` puts the ``i``-th
    shadow into its ``i``-th free slot; ``ValueError`` if some rank lacks the slots.
    """
    phy2log = masters.phy2log.copy()
    num_ranks, slots = phy2log.shape
    j = int(experts.size)
    if j == 0:
        return masters
    occupied = phy2log >= 0
    free_count = slots - occupied.sum(axis=1)
    if free_count.min() < j:
        raise ValueError(f"{j} shadows need {j} free slots on every rank")
    free_slots = np.argsort(occupied, axis=1, kind="stable")[:, :j]  # [R, j] free first
    value = np.broadcast_to(experts.astype(np.int32), (num_ranks, j)).copy()
    own = masters.master_rank()[experts][None, :] == np.arange(num_ranks)[:, None]
    value[own] = -1  # the master's rank already holds it
    rows = np.repeat(np.arange(num_ranks), j)
    phy2log[rows, free_slots.ravel()] = value.ravel()
    return Placement(phy2log=phy2log, master=masters.master.copy())


class FasterMoESettings(PolicySettings):
    """Settings of :class:`FasterMoEPolicy`."""

    max_shadows: int | None = Field(
        default=None,
        ge=0,
        le=4096,
        description="most experts shadowed at once (None: as many as every rank has free slots)",
    )
    cost: CostSettings = Field(
        default_factory=CostSettings, description="the cost model the shadowing rule minimizes"
    )


@register
class FasterMoEPolicy(Policy):
    """Shadow the hottest experts on every rank while the modeled step time keeps falling."""

    name = "fastermoe"
    Settings = FasterMoESettings
    relabel_ranks = False
    #: the even split its route uses: own rank's copy, else the only copy (the master)
    even_split: ClassVar[tuple[str, str]] = ("rank", "spread")

    @property
    def cfg(self) -> FasterMoESettings:
        return cast(FasterMoESettings, self.settings)

    def masters(self, ctx: PolicyContext) -> Placement:
        """The master-only placement shadows are added to (static EP's, kept forever)."""
        if ctx.previous is None:
            t = ctx.topology
            return static_placement(
                t.num_ranks, t.slots_per_rank, ctx.model.num_experts, t.masters_per_rank
            )
        prev = ctx.previous.placement
        phy2log = np.full_like(prev.phy2log, -1)
        flat = phy2log.reshape(-1)
        flat[prev.master] = np.arange(prev.master.size)
        return Placement(phy2log=phy2log, master=prev.master.copy())

    def place(self, ctx: PolicyContext) -> Placement:
        base = self.masters(ctx)
        free = base.slots_per_rank - (base.phy2log >= 0).sum(axis=1)
        limit = int(free.min())
        if self.cfg.max_shadows is not None:
            limit = min(limit, self.cfg.max_shadows)
        order = np.argsort(-ctx.load.sum(axis=0), kind="stable")

        def cost(p: Placement) -> float:
            return placement_cost(
                ctx.topology, ctx.model, ctx.load, p,
                domain="rank", remote="spread", settings=self.cfg.cost,
            ).seconds  # fmt: skip

        best, best_cost = base, cost(base)
        for j in range(1, limit + 1):
            cand = shadow(base, order[:j])
            c = cost(cand)
            if c >= best_cost:
                break
            best, best_cost = cand, c
        return best

    def route(self, ctx: PolicyContext, placement: Placement) -> np.ndarray:
        return route_even(ctx.load, placement, np.arange(ctx.topology.num_ranks))
