"""The fast loop's split by DC, every microbatch, and the fused sizes exchange it gives.

With ``spread`` (and ``balance``), the MoE layer does not follow the committed route for
tokens that must cross: every rank all-gathers the world's exact per-expert counts
([R, E]) and computes the same split by DC
(:func:`~expertmesh.planner.dcsplit.split_dcs`): a token whose DC holds its expert stays
home, the others cross to the holders so that the DCs' tokens per rank even out (to the
cheapest holders by the link shaper's bandwidths when it has them). Within a DC, a
token goes to the DC's *holder* of its expert (the lowest live rank holding it).

*Fused* (the layer's default): since every rank knows the whole split, it also knows what
every other rank will send it, so the counts all-gather doubles as the dispatch's sizes
exchange (:func:`relay_sizes`); the layer then has one WAN round trip before the tokens
move. A crossing bundle carries one row per assignment, since the distinct tokens of
another rank's bundle are not known.

Shapes: ``R`` ranks, ``E`` experts, ``D`` DCs, ``G`` world members, ``n`` tokens, ``k``
top-k.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from expertmesh.planner.dcsplit import can_spread as _can_spread
from expertmesh.planner.dcsplit import split_dcs
from expertmesh.workers.comm import Comm
from expertmesh.workers.moe import relay_counts, relay_rank, split_destinations

__all__ = ["DcSpread", "can_spread", "dc_holders", "relay_sizes", "relayed_sources", "spread"]


def dc_holders(holds: np.ndarray, dc_ranks: list[np.ndarray]) -> np.ndarray:
    """[D, E] each DC's holder of each expert: the lowest live rank of the DC holding it
    (-1 none); ``holds`` [R, E] bool, ``dc_ranks[d]`` the live ranks of DC ``d``, ascending."""
    holder = np.full((len(dc_ranks), holds.shape[1]), -1, np.int64)
    for d, ranks in enumerate(dc_ranks):
        for r in ranks[::-1].tolist():  # the lowest rank written last
            holder[d, holds[r]] = r
    return holder


def can_spread(holder: np.ndarray, dc_ranks: list[np.ndarray]) -> bool:
    """Whether the split by DC has a choice to make: an expert some live DC lacks and two
    or more live DCs hold (else the route's destinations are the only ones, and the DC's
    own counts all-gather is enough); ``holder`` [D, E] from :func:`dc_holders`."""
    live = np.array([r.size > 0 for r in dc_ranks])
    return _can_spread(holder[live] >= 0)  # [D_live, E]


def relayed_sources(comm: Comm) -> list[tuple[int, int]]:
    """(world index, rank) of the other DCs' ranks whose bundles for this rank's DC relay
    through this rank."""
    c = comm
    return [
        (i, r) for i, r in enumerate(c.world.ranks)
        if c.rank_dc[r] != c.dc and relay_rank(r, c.dc, c.rank_dc) == c.rank
    ]  # fmt: skip


@dataclass
class DcSpread:
    """One microbatch's split by DC as this rank uses it.

    ``dst`` [n, k] the destination rank of each assignment; ``dc_counts`` [Rd, E] what each
    rank of this DC holds after the dispatch (the fast loop's counts, no DC all-gather
    needed); ``tokens`` [R, E, D] the whole split when fused (else None); ``floor`` the
    split's max DC tokens per rank over the mean; ``counts_seconds`` the world counts
    all-gather; ``seconds`` the split (plus the all-gather unless fused: fused, the
    all-gather stands in for the dispatch's sizes exchange every mode has)."""

    dst: np.ndarray
    dc_counts: np.ndarray
    tokens: np.ndarray | None
    floor: float
    counts_seconds: float
    seconds: float


def spread(
    comm: Comm,
    counts: np.ndarray,
    idx: np.ndarray,
    holder: np.ndarray,
    dc_cost: np.ndarray | None,
    *,
    fused: bool,
) -> DcSpread:
    """The split by DC of this microbatch: all-gather the world's ``counts`` (this rank's
    [E]), split, and give this rank's assignments ``idx`` [n, k] their destinations.
    ``holder`` [D, E] from :func:`dc_holders`; ``dc_cost`` [D, D] cost per byte between
    DCs (None: equal). Every rank computes the same split."""
    t0 = time.perf_counter()
    c = comm
    rows = c.all_gather_rows(counts, c.world)  # [G, E]
    t1 = time.perf_counter()
    world = np.zeros((c.rank_dc.size, counts.size), np.int64)  # [R, E]
    world[c.world.ranks] = rows
    split = split_dcs(world, holder >= 0, c.rank_dc, dc_cost)
    dc_counts = relay_counts(split.tokens, c.dc, c.rank_dc)
    dst = split_destinations(idx, split.tokens[c.rank], holder)
    return DcSpread(
        dst=dst,
        dc_counts=dc_counts,
        tokens=split.tokens if fused else None,
        floor=split.floor,
        counts_seconds=t1 - t0,
        seconds=time.perf_counter() - (t1 if fused else t0),
    )


def relay_sizes(
    comm: Comm, split: np.ndarray, relayed: list[tuple[int, int]], sizes: np.ndarray
) -> np.ndarray:
    """[G, 2] (rows, assignments) each world member sends this rank in stage A of the
    dispatch, read off the world's ``split`` [R, E, D] (the same on every rank) instead of
    exchanged: this rank's own bundle (``sizes`` [G, 2], what it sends), and one row per
    assignment from each rank of another DC whose relay it is (``relayed``, from
    :func:`relayed_sources`)."""
    c = comm
    got = np.zeros_like(sizes)
    me = c.world.index[c.rank]
    got[me] = sizes[me]
    for i, r in relayed:
        m = int(split[r, :, c.dc].sum())
        got[i] = (m, m)
    return got
