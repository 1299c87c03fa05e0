"""Modeled time of one whole SPMD training step as the runtime runs it (docs/cost-model.md).

:func:`spmd_step_cost`: the collectives a step issues (:class:`SpmdCollectives`), which
of them cross DCs, latency and bandwidth per crossing, two calibrated machine constants.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from expertmesh.planner.plan import Placement
from expertmesh.planner.topology import Topology

__all__ = ["SpmdCollectives", "SpmdStepTime", "spmd_step_cost", "sync_hops"]


# ---- the SPMD data plane (expertmesh.workers.spmd over torch.distributed) ----


@dataclass(frozen=True)
class SpmdCollectives:
    """The collectives one SPMD training step issues, in the order every rank runs them.

    Per microbatch and layer (:class:`expertmesh.workers.layer.MoELayer`): when the layer's
    plan lets tokens cross DCs (``cross``), 5 world collectives that cross (forward: the
    bundle sizes, stage A dispatch, combine A; backward: combine A and stage A back); always
    5 inside the DC (fan-out sizes, stage B, combine B, and their 2 backward); with the fast
    loop (``balance``) 1 more in the DC (the counts all-gather) and 2 when it fetches
    replicas (``fetch``: the weights, and their gradients home). Per step (``SpmdRank.sync``):
    2 in the DC (dense gradient sum, broadcast) and, with several DCs, 1 across the DC
    leaders; then the expert sync, one world all-to-all per non-empty hop (``hops``:
    replica gradients in DC, over the WAN, fresh weights over the WAN, in DC; the WAN
    ones cross). A plan switch adds its migration's collectives (``migration``, of which
    ``migration_cross`` send between DCs).
    """

    total: int
    crossing: int

    @classmethod
    def of(
        cls,
        cross: Sequence[bool],
        *,
        microbatches: int = 1,
        num_dcs: int = 2,
        balance: bool = False,
        fetch: Sequence[bool] | None = None,
        hops: Sequence[bool] = (False, False, False, False),
        migration: int = 0,
        migration_cross: int = 0,
    ) -> SpmdCollectives:
        if microbatches < 1 or num_dcs < 1 or migration_cross > migration or len(hops) != 4:
            raise ValueError("microbatches, num_dcs >= 1; migration_cross <= migration; 4 hops")
        fetch = fetch if fetch is not None else [False] * len(cross)
        if len(fetch) != len(cross):
            raise ValueError("need one fetch flag per layer")
        per_mb_total = per_mb_cross = 0
        for c, f in zip(cross, fetch, strict=True):
            local = 5 + ((1 + (2 if f else 0)) if balance else 0)
            per_mb_cross += 5 if c else 0
            per_mb_total += local + (5 if c else 0)
        leaders = 1 if num_dcs > 1 else 0
        sync_cross = leaders + int(hops[1]) + int(hops[2])
        sync_total = 2 + leaders + sum(int(h) for h in hops)
        return cls(
            total=microbatches * per_mb_total + sync_total + migration,
            crossing=microbatches * per_mb_cross + sync_cross + migration_cross,
        )


def sync_hops(placements: Sequence[Placement], topology: Topology) -> tuple[bool, ...]:
    """Which of the expert sync's four hops carry anything under ``placements`` (per layer):
    replica gradients to the DC's lead holder, lead holders' gradients to a master in
    another DC, the master's fresh weights back over the WAN, and inside the DC."""
    in_dc = wan = False
    for p in placements:
        holds = p.holds()  # [R, E]
        master_dc = topology.rank_dc[p.master_rank()]  # [E]
        for d in range(topology.num_dcs):
            copies = holds[topology.rank_dc == d].sum(axis=0)  # [E]
            in_dc = in_dc or bool((copies >= 2).any())
            wan = wan or bool(((copies >= 1) & (master_dc != d)).any())
    return (in_dc, wan, wan, in_dc)


@dataclass(frozen=True)
class SpmdStepTime:
    """A modeled SPMD training step (seconds) and its parts."""

    seconds: float
    compute: float
    software: float  # per-collective cost times the collectives
    latency: float  # crossing collectives times the pair latency
    transfer: float  # the busiest DC pair's bytes over its bandwidth
    collectives: SpmdCollectives


def spmd_step_cost(
    topology: Topology,
    collectives: SpmdCollectives,
    pair_bytes: np.ndarray,
    *,
    tokens_per_rank: float,
    seconds_per_token: float,
    collective_seconds: float,
) -> SpmdStepTime:
    """Modeled wall time of one SPMD training step (end to end, plan switch included):

    ```
    T = a * tokens_per_rank + c * collectives.total
        + collectives.crossing * L + max_ab bytes_ab / B_ab
    ```

    ``a`` (``seconds_per_token``: compute and intra-DC copies per token a rank trains)
    and ``c`` (``collective_seconds``: the software cost of one collective, whether it
    crosses or not) are machine constants, calibrated on static EP over free links.
    Every crossing collective waits for its slowest pair's latency ``L`` (the largest
    inter-DC latency; the link shaper books each send on its DC pair's bucket and the
    sender waits for arrival), and the step's bytes between DCs (``pair_bytes`` [D, D]:
    tokens, weights and migration a -> b) pass at the pair's bandwidth ``B``; the busiest
    pair bounds it (pairs run in parallel, a pair's sends queue in its bucket).
    """
    num_dcs = topology.num_dcs
    nbytes = np.asarray(pair_bytes, dtype=np.float64)
    if nbytes.shape != (num_dcs, num_dcs) or (nbytes < 0).any():
        raise ValueError(f"pair_bytes must be [{num_dcs}, {num_dcs}] and >= 0")
    if min(tokens_per_rank, seconds_per_token, collective_seconds) < 0:
        raise ValueError("tokens, seconds per token and per collective must be >= 0")
    off = ~np.eye(num_dcs, dtype=bool)
    lat = float(topology.dc_latency_ms[off].max()) / 1e3 if num_dcs > 1 else 0.0
    busy = (nbytes > 0) & off
    transfer = (
        float(np.max(nbytes[busy] / (topology.dc_gbps[busy] * 1e9 / 8.0))) if busy.any() else 0.0
    )
    compute = seconds_per_token * tokens_per_rank
    software = collective_seconds * collectives.total
    latency = lat * collectives.crossing
    return SpmdStepTime(
        seconds=compute + software + latency + transfer,
        compute=compute,
        software=software,
        latency=latency,
        transfer=transfer,
        collectives=collectives,
    )
