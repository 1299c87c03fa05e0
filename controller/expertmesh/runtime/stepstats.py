"""What the controller derives from one SPMD step's reports (pure; no Ray): the measured
balance per microbatch and layer, split into what balancing inside each DC reaches and the
floor between DCs, and the plan switch the ranks made."""

from __future__ import annotations

from typing import Any

import numpy as np

from expertmesh.planner import imbalance

__all__ = ["per_microbatch", "switch_summary"]


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
