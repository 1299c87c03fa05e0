"""Modeled time of one whole training step as the runtimes run it (docs/cost-model.md).

Two data planes: the Ray-rounds plane (``expertmesh demo --data-plane rounds``;
:func:`training_step_cost`, below) and the SPMD plane over torch.distributed
(:func:`spmd_step_cost` at the end: the collectives a step issues, which of them cross
DCs, latency and bandwidth per crossing, two calibrated machine constants).

:func:`~expertmesh.planner.costmodel.step_cost` models one MoE layer with the
replica gradients on its backward tail and the replica refresh in the
background. The runtime (``expertmesh.runtime``) runs a step as a strict
sequence of *rounds* (one Ray task per rank each) instead: every layer's token
chain (dispatch, compute, combine and their backward), then a *gradient* phase
(replica gradients to their masters and the data-parallel dense gradient sums
between DCs, every layer at once), then a *refresh* phase (masters' new weights
to their replicas). Nothing overlaps. :class:`StepLayout` says which rounds a
plan needs (:func:`step_layout`); :func:`training_step_cost` composes the cost
model's equations in that order:

```
T = sum_l chain_l                                   step_cost of layer l, no expert streams, o = 0
  + max_ab (L_ab + (sum_l g_ab,l + dense_ab) / B_ab)         gradient phase
  + max_ab (L_ab + sum_l w_ab,l / B_ab)                      refresh phase
  + o * rounds                                              fixed time of every round
```

with ``g``/``w`` the WAN bytes of :func:`~expertmesh.planner.costmodel.replica_streams`
(tail / background) under the plan's encoding, ``dense_ab = dense_params * grad_bytes``
on every ordered DC pair (a pair term counts only when the pair carries bytes),
``o`` = ``CostSettings.message_seconds`` and ``rounds`` = :attr:`StepLayout.rounds`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from expertmesh.planner.costmodel import (
    CostSettings,
    TransferEncoding,
    replica_streams,
    step_cost,
)
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import Placement
from expertmesh.planner.topology import Topology
from expertmesh.planner.traffic import TokenTraffic

__all__ = [
    "SpmdCollectives",
    "SpmdStepTime",
    "StepLayout",
    "StepTime",
    "spmd_step_cost",
    "step_layout",
    "sync_hops",
    "training_step_cost",
]


@dataclass(frozen=True)
class StepLayout:
    """Which rounds one training step of the runtime runs.

    - ``relay``: [L] per layer, whether its tokens can cross DCs. Then dispatch goes
      source -> the remote DC's relay -> the experts and combine back the same way
      (hierarchical), two rounds each way, forward and backward: 8 rounds. Otherwise
      (every DC holds every expert and the route keeps every token in its DC) one round
      each: 4.
    - ``fanout``: whether a DC holds two or more copies of an expert mastered elsewhere:
      refreshed weights then cross once and fan out inside it, one more round.

    A step is 1 (embed and gate) + the layers' rounds + 2 (replica gradients over the WAN
    and dense sums between DCs; masters step and send fresh weights) + 1 (store and apply
    the dense step) + 1 if ``fanout``. (Replica gradients to the DC's lead holder and
    dense gradients to the DC leader leave in the round of layer 0's backward.)
    """

    relay: tuple[bool, ...]
    fanout: bool = True

    @classmethod
    def full(cls, num_layers: int) -> StepLayout:
        """Every round (right for any plan)."""
        return cls((True,) * num_layers, True)

    @property
    def rounds(self) -> int:
        return 1 + sum(8 if r else 4 for r in self.relay) + (4 if self.fanout else 3)

    def covers(self, other: StepLayout) -> bool:
        """Whether this layout runs every round ``other`` needs."""
        return (
            len(self.relay) == len(other.relay)
            and all(a or not b for a, b in zip(self.relay, other.relay, strict=True))
            and (self.fanout or not other.fanout)
        )


def step_layout(
    placements: Sequence[Placement],
    routes: Sequence[np.ndarray],
    topology: Topology,
    live: np.ndarray | None = None,
) -> StepLayout:
    """The rounds a step under ``placements`` and ``routes`` (per layer [N, 4] rows
    ``(src_rank, expert, dst_rank, tokens)``) needs, with only the ``live`` [R] ranks
    taking part (default all).

    A layer needs no relay when every DC with a live rank holds every expert on a live
    rank and no route row of a live source with tokens leaves its DC (a token the route
    did not see goes to a copy in its own DC).
    """
    if len(placements) != len(routes):
        raise ValueError("need one route per placement")
    num_ranks = topology.num_ranks
    live = np.ones(num_ranks, bool) if live is None else np.asarray(live, dtype=bool)
    if live.shape != (num_ranks,):
        raise ValueError(f"live must be [{num_ranks}] bools")
    rank_dc = np.where(live, topology.rank_dc, -1)  # [R]; -1: not taking part
    dcs = np.unique(rank_dc[live])
    relay, fanout = [], False
    for placement, route in zip(placements, routes, strict=True):
        holds = placement.holds() & live[:, None]  # [R, E]
        per_dc = np.stack([holds[rank_dc == d].sum(axis=0) for d in dcs])  # [D', E] copies
        rows = np.asarray(route, np.int64).reshape(-1, 4)
        rows = rows[(rows[:, 3] > 0) & live[rows[:, 0]]]
        leaves = (rank_dc[rows[:, 0]] != rank_dc[rows[:, 2]]).any()
        relay.append(bool(leaves or (per_dc == 0).any()))
        master_dc = rank_dc[placement.master_rank()]  # [E]
        remote = dcs[:, None] != master_dc[None, :]  # [D', E]
        fanout = fanout or bool((remote & (per_dc >= 2)).any())
    return StepLayout(tuple(relay), fanout)


@dataclass(frozen=True)
class StepTime:
    """A modeled training step (seconds) and its parts.

    ``layers``: [L] each layer's token chain (its rounds' ``o`` and compute included);
    ``compute``: the compute part of all chains; ``messages``: ``o`` times the rounds of
    the step (:attr:`StepLayout.rounds`); ``gradient``/``refresh``: the two sync phases
    (with their rounds' ``o``; the first round, embed and gate, is in ``seconds`` only).
    """

    seconds: float
    layers: list[float] = field(default_factory=list)
    compute: float = 0.0
    messages: float = 0.0
    gradient: float = 0.0
    refresh: float = 0.0
    cross_dc_token_bytes: float = 0.0
    cross_dc_weight_bytes: float = 0.0


def training_step_cost(
    topology: Topology,
    model: ModelSpec,
    traffic: Sequence[TokenTraffic],
    placements: Sequence[Placement],
    *,
    dense_params: int = 0,
    settings: CostSettings | None = None,
    encoding: TransferEncoding | None = None,
    layout: StepLayout | None = None,
) -> StepTime:
    """Modeled seconds of one training step of every layer, run in sequence.

    - ``traffic``: per layer the step's token streams (``pair_crossings`` exact when known).
    - ``placements``: per layer the placement the step runs on (its replicas sync).
    - ``dense_params``: parameters outside the experts (data parallel); their gradient sum
      crosses every ordered DC pair once per step.
    - ``encoding``: how replica gradients and refreshes travel (None: the model's bytes).
    - ``layout``: the rounds the runtime runs (:func:`step_layout` of the plan); None: a
      layer relays when its traffic crosses DCs, fan-out from ``placements``.

    ``ValueError`` unless the model trains, one optimizer step per microbatch
    (``microbatches_per_update == 1``), and there is one traffic and placement per layer.
    """
    settings = settings or CostSettings()
    if not model.training:
        raise ValueError("training_step_cost models a training step (model.training is False)")
    if settings.microbatches_per_update != 1:
        raise ValueError("the runtime updates every step: microbatches_per_update must be 1")
    if not (len(traffic) == len(placements) == model.num_layers):
        raise ValueError(
            f"need one traffic and one placement per layer ({model.num_layers}), got "
            f"{len(traffic)} and {len(placements)}"
        )
    if dense_params < 0:
        raise ValueError("dense_params must be >= 0")
    if settings.pipeline_chunks != 1:
        raise ValueError("the runtime does not pipeline: pipeline_chunks must be 1")
    if layout is not None and len(layout.relay) != model.num_layers:
        raise ValueError(f"layout has {len(layout.relay)} layers, the model {model.num_layers}")
    o = settings.message_seconds
    chain_settings = settings.model_copy(update={"message_seconds": 0.0})
    num_dcs = topology.num_dcs
    grads = np.zeros((num_dcs, num_dcs))  # [D, D] bytes a -> b in the gradient phase
    fresh = np.zeros((num_dcs, num_dcs))  # [D, D] bytes a -> b in the refresh phase
    layers, compute, tokens, relay = [], 0.0, 0.0, []
    for tr, placement in zip(traffic, placements, strict=True):
        cost = step_cost(topology, model, tr, None, chain_settings)
        relay.append(cost.cross_dc_token_bytes > 0)
        layers.append(cost.seconds)
        compute += cost.phases["compute_fwd"] + cost.phases["compute_bwd"]
        tokens += cost.cross_dc_token_bytes
        st = replica_streams(placement, topology, model, settings, encoding)
        np.add.at(grads, (st.pair_src, st.pair_dst), st.pair_tail)
        np.add.at(fresh, (st.pair_src, st.pair_dst), st.pair_background)
    weights = float(grads.sum() + fresh.sum())
    if num_dcs > 1 and dense_params:
        dense = float(dense_params * model.grad_bytes)  # dense gradients travel unencoded
        grads += dense * (1.0 - np.eye(num_dcs))
        weights += dense * num_dcs * (num_dcs - 1)
    if layout is None:
        empty = [np.zeros((0, 4), np.int64)] * len(placements)
        layout = StepLayout(tuple(relay), step_layout(placements, empty, topology).fanout)
    layers = [t + o * (8 if r else 4) for t, r in zip(layers, layout.relay, strict=True)]
    gradient = 2 * o + _link_phase(grads, topology)
    refresh = (2 if layout.fanout else 1) * o + _link_phase(fresh, topology)
    return StepTime(
        seconds=float(o + sum(layers) + gradient + refresh),
        layers=layers,
        compute=compute,
        messages=o * layout.rounds,
        gradient=gradient,
        refresh=refresh,
        cross_dc_token_bytes=tokens,
        cross_dc_weight_bytes=weights,
    )


def _link_phase(nbytes: np.ndarray, topology: Topology) -> float:
    """Slowest ordered DC pair of ``nbytes`` [D, D]: ``L + bytes / B`` (0 if none carry)."""
    busy = nbytes > 0
    np.fill_diagonal(busy, False)
    if not busy.any():
        return 0.0
    bw = topology.dc_gbps[busy] * 1e9 / 8.0
    lat = topology.dc_latency_ms[busy] / 1e3
    return float(np.max(lat + nbytes[busy] / bw))


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
