"""Migration: turn an old placement into a new one with the least traffic.

FIRST CUT (to be replaced by the full algorithm): slots are aligned inside each
rank so copies that stay keep their slot, and each new copy is sent from the
nearest holder of the old placement, one transfer per round.
"""

from __future__ import annotations

import numpy as np

from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import Migration, Placement, Transfer, TransferKind
from expertmesh.planner.topology import Topology

__all__ = ["align_placement", "plan_migration"]


def align_placement(
    old: Placement, new: Placement, topology: Topology, relabel_ranks: bool = False
) -> Placement:
    """Permute slots of each rank of ``new`` so copies already in ``old`` keep their slot."""
    del topology, relabel_ranks
    num_ranks, num_slots = new.phy2log.shape
    out = np.full_like(new.phy2log, -1)
    for r in range(num_ranks):
        want = list(new.phy2log[r])
        placed = [False] * num_slots
        for s in range(num_slots):
            e = old.phy2log[r, s]
            if e >= 0 and e in want:
                want.remove(e)
                out[r, s] = e
                placed[s] = True
        free = [s for s in range(num_slots) if not placed[s]]
        rest = sorted((e for e in want if e >= 0), reverse=True) + [-1] * sum(
            1 for e in want if e < 0
        )
        for s, e in zip(free, rest, strict=True):
            out[r, s] = e
    flat_old_master_rank = new.master // num_slots
    master = np.empty_like(new.master)
    for e, r in enumerate(flat_old_master_rank):
        master[e] = r * num_slots + int(np.flatnonzero(out[r] == e)[0])
    return Placement(phy2log=out, master=master)


def plan_migration(
    old: Placement, new: Placement, topology: Topology, model: ModelSpec
) -> Migration:
    """Transfers that make ``new`` from ``old``: each new copy from the nearest old holder."""
    moved = (new.phy2log >= 0) & (new.phy2log != old.phy2log)
    kept = int(((new.phy2log >= 0) & ~moved).sum())
    holders = old.holds()
    transfers: list[Transfer] = []
    seconds: list[float] = []
    for r, s in zip(*np.nonzero(moved), strict=True):
        e = int(new.phy2log[r, s])
        src = np.flatnonzero(holders[:, e])
        src_rank = int(src[np.argmin(topology.distance(src, np.full_like(src, r)))])
        nbytes = model.expert_bytes
        transfers.append(
            Transfer(e, src_rank, int(r), int(s), nbytes, len(seconds), TransferKind.REPLICA)
        )
        bw = float(topology.bandwidth_Bps(np.array([src_rank]), np.array([r]))[0])
        lat = float(topology.latency_s(np.array([src_rank]), np.array([r]))[0])
        seconds.append(lat + nbytes / bw)
    return Migration(transfers=tuple(transfers), round_seconds=tuple(seconds), kept=kept)
