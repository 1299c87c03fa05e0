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

__all__ = ["SpmdCollectives", "SpmdStepTime", "copies_per_rank", "spmd_step_cost", "sync_hops"]


# ---- the SPMD data plane (expertmesh.workers.spmd over torch.distributed) ----


@dataclass(frozen=True)
class SpmdCollectives:
    """The collectives one SPMD training step issues, in the order every rank runs them.

    Per microbatch and layer (:class:`expertmesh.workers.layer.MoELayer`): when the layer's
    plan lets tokens cross DCs (``cross``), 5 world collectives that cross (forward: the
    bundle sizes, stage A dispatch, combine A; backward: combine A and stage A back); always
    5 inside the DC (fan-out sizes, stage B, combine B, and their 2 backward); with the fast
    loop (``balance``) 1 more in the DC (the counts all-gather) and 2 when it fetches
    replicas (``fetch``: the weights, and their gradients home); where the fast loop also
    splits crossing tokens by DC (``spread``, per layer: the layer's tokens cross and two
    or more DCs hold an expert some DC lacks) the counts all-gather runs over the world
    and crosses, and with ``fused`` it stands in for the bundle sizes exchange (which is
    then not issued). Per step (``SpmdRank.sync``):
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
        spread: Sequence[bool] | None = None,
        fused: bool = False,
    ) -> SpmdCollectives:
        if microbatches < 1 or num_dcs < 1 or migration_cross > migration or len(hops) != 4:
            raise ValueError("microbatches, num_dcs >= 1; migration_cross <= migration; 4 hops")
        fetch = fetch if fetch is not None else [False] * len(cross)
        spread = spread if spread is not None else [False] * len(cross)
        if len(fetch) != len(cross) or len(spread) != len(cross):
            raise ValueError("need one fetch and one spread flag per layer")
        per_mb_total = per_mb_cross = 0
        for c, f, sp in zip(cross, fetch, spread, strict=True):
            world = bool(balance and sp and c)  # the counts all-gather over the world
            local = 5 + ((int(not world) + (2 if f else 0)) if balance else 0)
            crossing = (5 - int(world and fused) + int(world)) if c else 0
            per_mb_cross += crossing
            per_mb_total += local + crossing
        leaders = 1 if num_dcs > 1 else 0
        sync_cross = leaders + int(hops[1]) + int(hops[2])
        sync_total = 2 + leaders + sum(int(h) for h in hops)
        return cls(
            total=microbatches * per_mb_total + sync_total + migration,
            crossing=microbatches * per_mb_cross + sync_cross + migration_cross,
        )


def sync_hops(
    placements: Sequence[Placement],
    topology: Topology,
    new: Sequence[Placement] | None = None,
) -> tuple[bool, ...]:
    """Which of the expert sync's four hops carry anything (the workers'
    ``expertmesh.workers.hops.plan_hops``), per layer: replica gradients from
    ``placements``' holders to their DC's lead (the master when the DC has it, else the
    DC's lowest holder), the leads' gradients over the WAN to the master, the master's
    fresh weights back over the WAN to ``new``'s holders, and inside the DC. ``new``: the
    plan a background switch commits at this step's sync (its masters receive the
    gradients, its holders the refresh); None: ``placements``."""
    new = placements if new is None else new
    hops = [False, False, False, False]
    for a, b in zip(placements, new, strict=True):
        m = b.master_rank()  # [E]
        mdc = topology.rank_dc[m]
        experts = np.arange(m.size)
        # gradients from a's holders (hops 0: in DC, 1: WAN), weights to b's (3: in DC, 2: WAN)
        for holds, dc_hop, wan_hop in ((a.holds(), 0, 1), (b.holds(), 3, 2)):  # [R, E]
            mine = holds[m, experts]  # whether the master holds e under this plan
            for d in range(topology.num_dcs):
                copies = holds[topology.rank_dc == d].sum(axis=0)  # [E]
                here = mdc == d
                # in the DC: a holder other than the DC's lead
                in_dc = np.where(here, copies - mine > 0, copies >= 2)
                hops[dc_hop] = hops[dc_hop] or bool(in_dc.any())
                hops[wan_hop] = hops[wan_hop] or bool((~here & (copies > 0)).any())
    return tuple(hops)


def copies_per_rank(placements: Sequence[Placement], live: np.ndarray | None = None) -> float:
    """The (layer, expert) copies ``placements`` (one per layer) give a rank, the mean over
    the ranks ``live`` marks (None: all); two slots of one expert on a rank count once, as
    the workers hold them (``LayerPlan.held_by``)."""
    total, ranks = 0, None
    for p in placements:
        holds = p.holds()  # [R, E]
        if live is not None:
            holds = holds[np.asarray(live, bool)]
        total += int(holds.sum())
        ranks = holds.shape[0]
    return total / ranks if ranks else 0.0


@dataclass(frozen=True)
class SpmdStepTime:
    """A modeled SPMD training step (seconds) and its parts."""

    seconds: float
    compute: float
    software: float  # per-collective cost times the collectives
    copies: float  # per-copy cost times the expert copies a rank holds
    latency: float  # crossing collectives times the pair latency
    transfer: (
        float  # per crossing collective its busiest DC pair's bytes over its bandwidth, summed
    )
    collectives: SpmdCollectives


def spmd_step_cost(
    topology: Topology,
    collectives: SpmdCollectives,
    pair_bytes: np.ndarray,
    *,
    tokens_per_rank: float,
    seconds_per_token: float,
    collective_seconds: float,
    copies_per_rank: float = 0.0,
    copy_seconds: float = 0.0,
) -> SpmdStepTime:
    """Modeled wall time of one SPMD training step (end to end, plan switch included):

    ```
    T = a * tokens_per_rank + c * collectives.total + h * copies_per_rank
        + collectives.crossing * L + sum_c max_ab bytes_cab / B_ab
    ```

    ``a`` (``seconds_per_token``: compute and intra-DC copies per token a rank trains),
    ``c`` (``collective_seconds``: the software cost of one collective, whether it
    crosses or not) and ``h`` (``copy_seconds``: the cost of one expert copy a rank
    holds, per step: its own expert call forward and backward, its gradient's and fresh
    weights' packing in the expert sync, its Adam step where it is the master) are
    machine constants, calibrated on static EP over free links (``h`` on a second
    layout, :func:`expertmesh.runtime.settings.replicated_placement`, that holds more
    copies); ``copies_per_rank``: the (layer, expert) copies the step's plan gives a
    rank, the mean over ranks.
    Every crossing collective waits for its slowest pair's latency ``L`` (the largest
    inter-DC latency; the link shaper books each send on its DC pair's bucket and the
    sender waits for arrival). Bytes: ``pair_bytes`` [C, D, D], what each of the step's
    ``C`` crossing collectives sent a -> b (tokens, weights, migration): the collectives
    run one after another, and within one the pairs run in parallel while a pair's sends
    queue in its bucket, so each collective takes its busiest pair's bytes over that
    pair's bandwidth ``B`` and the step the sum. [D, D] (the step's bytes, not split by
    collective) is read as one collective: the busiest pair of the step's total, a lower
    bound of the sum.
    """
    num_dcs = topology.num_dcs
    nbytes = np.asarray(pair_bytes, dtype=np.float64)
    if nbytes.ndim == 2:
        nbytes = nbytes[None]
    if nbytes.ndim != 3 or nbytes.shape[1:] != (num_dcs, num_dcs) or (nbytes < 0).any():
        raise ValueError(f"pair_bytes must be [C, {num_dcs}, {num_dcs}] or [D, D] and >= 0")
    if min(tokens_per_rank, seconds_per_token, collective_seconds, copies_per_rank,
           copy_seconds) < 0:  # fmt: skip
        raise ValueError("tokens, copies, seconds per token, collective and copy must be >= 0")
    off = ~np.eye(num_dcs, dtype=bool)
    lat = float(topology.dc_latency_ms[off].max()) / 1e3 if num_dcs > 1 else 0.0
    per_second = np.where(off, topology.dc_gbps * 1e9 / 8.0, np.inf)  # [D, D] bytes/s
    transfer = float(np.sum(np.max(np.where(off, nbytes / per_second, 0.0), axis=(1, 2))))
    compute = seconds_per_token * tokens_per_rank
    software = collective_seconds * collectives.total
    copies = copy_seconds * copies_per_rank
    latency = lat * collectives.crossing
    return SpmdStepTime(
        seconds=compute + software + copies + latency + transfer,
        compute=compute,
        software=software,
        copies=copies,
        latency=latency,
        transfer=transfer,
        collectives=collectives,
    )
