"""The expert sync of the SPMD data plane as transfers (pure: plans, the ranks' DCs and the
live ranks in; no torch, no process groups).

After every backward, each expert's gradients travel from the ranks that computed with a
copy to its master, inside each DC to the DC's *lead* holder and then once per DC over the
WAN, and its fresh weights travel back, over the WAN once per DC and then inside it
(:meth:`~expertmesh.workers.experts.ExpertParallel.step` runs the four hops). Every rank
computes the same lists from what every rank knows, so no sizes are exchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from expertmesh.workers.layerplan import LayerPlan

__all__ = ["HopCache", "Ranks", "Transfer", "plan_hops"]

Transfer = tuple[int, int, int, int, str]  # (layer, expert, src_rank, dst_rank, "g" | "w" | "opt")


class Ranks(Protocol):
    """What the hops read of a :class:`~expertmesh.workers.comm.Comm`."""

    rank_dc: np.ndarray  # [R] DC of each rank, -1: not taking part
    dc_ranks: list[np.ndarray]  # per DC its live ranks, ascending
    live: np.ndarray  # [R] bool


def _lead(c: Ranks, master: int, holds: np.ndarray, e: int, dc: int) -> int:
    """Where ``e``'s gradients meet in ``dc`` (and its weights enter it): the master when
    it is in ``dc``, else the DC's lowest rank that ``holds`` [R, E] marks."""
    if c.rank_dc[master] == dc:
        return master
    ranks = c.dc_ranks[dc]
    return int(ranks[holds[ranks, e]][0])


def plan_hops(
    c: Ranks, old: list[LayerPlan], new: list[LayerPlan], num_experts: Sequence[int]
) -> list[list[Transfer]]:
    """A step's four hops over the live ranks of ``c``: gradients from ``old``'s holders
    (who computed) to ``new``'s masters, inside each DC then over the WAN; fresh weights
    from ``new``'s masters to ``new``'s holders, over the WAN then inside each DC (``old``
    is ``new`` except at a plan switch). ``num_experts``: per layer."""
    hops: list[list[Transfer]] = [[], [], [], []]  # grads in DC, WAN; weights WAN, in DC
    for layer, (a, b) in enumerate(zip(old, new, strict=True)):
        for e in range(num_experts[layer]):
            m = int(b.master_rank[e])
            have = np.flatnonzero(a.holds[:, e] & c.live).tolist()
            want = np.flatnonzero(b.holds[:, e] & c.live).tolist()
            for h in have:
                lead = _lead(c, m, a.holds, e, int(c.rank_dc[h]))
                if h != lead:
                    hops[0].append((layer, e, h, lead, "g"))
            for dc in sorted({int(c.rank_dc[h]) for h in have} - {int(c.rank_dc[m])}):
                hops[1].append((layer, e, _lead(c, m, a.holds, e, dc), m, "g"))
            for dc in sorted({int(c.rank_dc[h]) for h in want} - {int(c.rank_dc[m])}):
                hops[2].append((layer, e, m, _lead(c, m, b.holds, e, dc), "w"))
            for h in want:
                lead = _lead(c, m, b.holds, e, int(c.rank_dc[h]))
                if h != lead:
                    hops[3].append((layer, e, lead, h, "w"))
    return hops


class HopCache:
    """:func:`plan_hops`, remembered: they depend only on the plans, the live ranks and the
    groups, so a step on the plan of the step before reuses them (the last two pairs are
    kept: a switch asks for its own hops and the committed plan's). Plans are matched by
    identity, ``c`` too (new groups: a new comm). Callers only read the lists."""

    def __init__(self, num_experts: Sequence[int]) -> None:
        self.num_experts = list(num_experts)
        self._last: list[tuple[tuple[Any, ...], list[list[Transfer]]]] = []

    def hops(self, c: Ranks, old: list[LayerPlan], new: list[LayerPlan]) -> list[list[Transfer]]:
        for key, hops in self._last:
            k_old, k_new, k_comm, k_live = key
            if (
                k_comm is c
                and len(k_old) == len(old)
                and len(k_new) == len(new)
                and all(a is b for a, b in zip(k_old, old, strict=True))
                and all(a is b for a, b in zip(k_new, new, strict=True))
                and np.array_equal(k_live, c.live)
            ):
                return hops
        hops = plan_hops(c, old, new, self.num_experts)
        entry = ((tuple(old), tuple(new), c, c.live.copy()), hops)
        self._last = [entry, *self._last[:1]]
        return hops
