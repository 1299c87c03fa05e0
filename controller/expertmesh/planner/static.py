"""``static``: plain expert parallelism. Masters spread evenly, no replicas, never moves."""

from __future__ import annotations

import numpy as np

from expertmesh.planner.plan import Placement
from expertmesh.planner.policy import Policy, PolicyContext, register
from expertmesh.planner.routing import route_even

__all__ = ["StaticPolicy", "static_placement"]


def static_placement(
    num_ranks: int, slots_per_rank: int, num_experts: int, masters_per_rank: int
) -> Placement:
    """Expert ``e`` on rank ``e * R // E`` (contiguous blocks of ``E / R`` experts).

    Needs ``E <= R * masters_per_rank``; slots past the masters stay empty.
    Returns ``phy2log`` [R, S] int32 and ``master`` [E].
    """
    if num_experts > num_ranks * masters_per_rank:
        raise ValueError(
            f"{num_experts} experts do not fit {num_ranks} ranks x {masters_per_rank} master slots"
        )
    experts = np.arange(num_experts)
    rank = experts * num_ranks // num_experts  # [E]
    first = np.searchsorted(rank, np.arange(num_ranks))  # first expert of each rank
    slot = experts - first[rank]
    phy2log = np.full((num_ranks, slots_per_rank), -1, dtype=np.int32)
    phy2log[rank, slot] = experts
    return Placement(phy2log=phy2log, master=(rank * slots_per_rank + slot).astype(np.int64))


@register
class StaticPolicy(Policy):
    """Static EP: the placement of :func:`static_placement`, tokens to the only copy."""

    name = "static"

    def place(self, ctx: PolicyContext) -> Placement:
        if ctx.previous is not None:
            return ctx.previous.placement
        t = ctx.topology
        return static_placement(
            t.num_ranks, t.slots_per_rank, ctx.model.num_experts, t.masters_per_rank
        )

    def route(self, ctx: PolicyContext, placement: Placement) -> np.ndarray:
        return route_even(ctx.load, placement)
