"""A layer's committed plan as a rank of the SPMD data plane uses it (no torch: the
replay, ``expertmesh.sim.replay``, asks it which layers let tokens cross DCs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from expertmesh.planner.plan import Placement

__all__ = ["LayerPlan"]


@dataclass(eq=False)
class LayerPlan:
    """A layer's committed plan as a rank uses it: ``placement`` and ``route`` [N, 4] rows
    ``(src_rank, expert, dst_rank, tokens)`` whose shares split each microbatch's tokens."""

    placement: Placement
    route: np.ndarray
    holds: np.ndarray = field(init=False)  # [R, E] bool
    master_rank: np.ndarray = field(init=False)  # [E]

    def __post_init__(self) -> None:
        self.route = np.asarray(self.route, dtype=np.int64).reshape(-1, 4)
        self.holds = self.placement.holds()
        self.master_rank = self.placement.master_rank()

    def crosses(self, rank_dc: np.ndarray) -> bool:
        """Whether any live rank (``rank_dc`` >= 0) may send tokens to another DC under this
        plan: a route row with tokens to a rank of another DC, or an expert with no route
        row for that rank and no live copy in its DC (the fallback sends it away). Every
        rank answers the same, so a plan that keeps tokens home skips the WAN exchange."""
        live = np.flatnonzero(rank_dc >= 0)
        r = self.route[self.route[:, 3] > 0]
        away = rank_dc[r[:, 0]] != rank_dc[r[:, 2]]
        if (away & (rank_dc[r[:, 0]] >= 0)).any():
            return True
        seen = np.zeros(self.holds.shape, bool)  # [R, E] (src, expert) pairs the route covers
        seen[r[:, 0], r[:, 1]] = True
        num_dcs = int(rank_dc.max()) + 1
        held_in = np.zeros((num_dcs, self.holds.shape[1]), bool)  # [D, E] live copy in DC
        for d in range(num_dcs):
            held_in[d] = self.holds[rank_dc == d].any(axis=0)
        return bool((~seen[live] & ~held_in[rank_dc[live]]).any())

    def held_by(self, rank: int) -> list[int]:
        """Distinct experts in ``rank``'s slots (two slots may hold one expert)."""
        return sorted({int(e) for e in self.placement.phy2log[rank] if e >= 0})
