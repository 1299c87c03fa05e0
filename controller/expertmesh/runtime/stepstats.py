"""What the controller derives from one SPMD step's reports (pure; no Ray): the measured
balance per microbatch and layer, split into what balancing inside each DC reaches and the
floor between DCs; the planner's level on the same exact counts (what the planner's own
solve reaches on them, beside what the ranks measured); and the plan switch the ranks
made."""

from __future__ import annotations

from typing import Any

import numpy as np

from expertmesh.planner import Placement, imbalance
from expertmesh.planner.dcsplit import split_dcs
from expertmesh.planner.fastquota import EXACT
from expertmesh.workers.balance import DomainBase, solve
from expertmesh.workers.moe import relay_counts

__all__ = ["PLANNER_RULE", "per_microbatch", "planner_level", "switch_summary"]

#: the solve inside each DC the planner's level uses: quota's exact rule (no replica
#: economy, as the ``quota`` policy plans) and the chains after it
PLANNER_RULE = EXACT.model_copy(update={"chains": True})


def per_microbatch(
    computed: np.ndarray, rank_dc: np.ndarray
) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    """Per microbatch and layer of one step, from ``computed`` [R', k, L] (assignments each
    reporting rank computed) and ``rank_dc`` [R'] (their DCs), three [k][L] grids:

    - measured: max/mean over the ranks;
    - within DC: the worst DC's max/mean over its own ranks (what balancing inside each
      DC reaches);
    - floor: the busiest DC's mean over the global mean (measured <= within x floor, and
      no balancing inside DCs goes below the floor)."""
    dcs = [rank_dc == d for d in np.unique(rank_dc)]
    measured, within, floor = [], [], []
    for i in range(computed.shape[1]):
        per = computed[:, i, :]  # [R', L]
        measured.append([imbalance(per[:, layer]) for layer in range(per.shape[1])])
        within.append([max(imbalance(per[m, layer]) for m in dcs) for layer in range(per.shape[1])])
        mean = per.mean(axis=0)  # [L]
        busiest = np.max([per[m].mean(axis=0) for m in dcs], axis=0)  # [L]
        floor.append([float(b / a) if a > 0 else 1.0 for a, b in zip(mean, busiest, strict=True)])
    return measured, within, floor


def planner_level(
    counts: np.ndarray,
    placements: list[Placement],
    rank_dc: np.ndarray,
    cost: np.ndarray | None = None,
) -> list[list[float]]:
    """What the planner reaches on one step's exact counts, per microbatch and layer: a
    [k][L] grid of max/mean tokens per rank, solved here from the counts alone (not from
    what the ranks did), so that the measured ``imbalance_microbatches`` can be held
    against it.

    - ``counts``: [k, L, R, E] every rank's gate counts per microbatch and layer (zero rows
      for ranks not taking part);
    - ``placements``: [L] the plan the step's tokens ran under (which experts each DC
      holds, where the homes are: the slow loop's decision);
    - ``rank_dc``: [R] DC of each rank, ``-1`` for one not taking part;
    - ``cost``: [D, D] per byte between DCs (as the workers' shaper), ``None``: equal.

    Per microbatch and layer: the split by DC of the crossing tokens at its exact level
    (:func:`~expertmesh.planner.dcsplit.split_dcs`; a token whose DC holds its expert
    stays home), then inside each DC quota's exact rule and the chains
    (:data:`PLANNER_RULE`) over the DC's base; max/mean over the ranks taking part."""
    counts = np.asarray(counts, dtype=np.int64)
    rank_dc = np.asarray(rank_dc, dtype=np.int64)
    if counts.ndim != 4 or counts.shape[1] != len(placements) or counts.shape[2] != rank_dc.size:
        raise ValueError(
            f"counts must be [k, {len(placements)}, {rank_dc.size}, E], got {counts.shape}"
        )
    live = rank_dc >= 0
    dcs = [np.flatnonzero(rank_dc == d) for d in range(int(rank_dc.max(initial=-1)) + 1)]
    # per layer, what its plan fixes for every microbatch: [D, E] holder sets over the live
    # ranks, and each DC's base (None for a DC without ranks)
    holds = [np.stack([p.holds()[m].any(axis=0) for m in dcs]) for p in placements]
    bases = [[DomainBase.of(p, m) if m.size else None for m in dcs] for p in placements]
    out: list[list[float]] = []
    for mb in counts:  # [L, R, E]
        row = []
        for layer in range(len(placements)):
            split = split_dcs(mb[layer], holds[layer], rank_dc, cost)
            per = np.zeros(rank_dc.size, np.int64)
            for d, ranks in enumerate(dcs):
                base = bases[layer][d]
                if base is None:
                    continue
                step = solve(relay_counts(split.tokens, d, rank_dc), base, settings=PLANNER_RULE)
                per[ranks] = np.bincount(step.route[:, 2], weights=step.route[:, 3],
                                         minlength=ranks.size).astype(np.int64)  # fmt: skip
            row.append(imbalance(per[live]))
        out.append(row)
    return out


def switch_summary(reports: dict[int, dict[str, Any]], ranks: list[int]) -> dict[str, Any] | None:
    """The plan switch the ranks made after this step, if any: its mode, the seconds it
    held each rank (max over ranks; background: starting the transfer, waiting for it,
    switching), and the bytes that crossed DCs at the boundary and in the background
    (summed over ranks)."""
    done = [reports[r]["applied"] for r in ranks if reports[r].get("applied")]
    if not done:
        return None

    def cross(key: str) -> int:
        tot = sum((np.asarray(a.get(key, [[0]])) for a in done), np.zeros((1, 1), np.int64))
        return int(tot.sum() - np.trace(tot))

    return {
        "version": int(done[0]["version"]),
        "mode": str(done[0].get("mode", "boundary")),
        "seconds": max(float(a["seconds"]) for a in done),
        "wait_seconds": max(float(a.get("wait_seconds", 0.0)) for a in done),
        "boundary_bytes": cross("boundary_bytes"),
        "background_bytes": cross("background_bytes"),
    }
