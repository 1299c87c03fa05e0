"""Modeled time of one whole training step as the runtime runs it (docs/cost-model.md).

:func:`~expertmesh.planner.costmodel.step_cost` models one MoE layer with the
replica gradients on its backward tail and the replica refresh in the
background. The runtime (``expertmesh.runtime``) runs a step as a strict
sequence instead: every layer's token chain (dispatch, compute, combine and
their backward), then one *gradient* phase (replica gradients to their masters
and the data-parallel dense gradient sums between DCs, every layer at once),
then one *refresh* phase (masters' new weights to their replicas). Nothing
overlaps. :func:`training_step_cost` composes the cost model's equations in
that order:

```
T = sum_l chain_l                                   step_cost of layer l without expert streams
  + o + max_ab (L_ab + (sum_l g_ab,l + dense_ab) / B_ab)     gradient phase
  + o + max_ab (L_ab + sum_l w_ab,l / B_ab)                  refresh phase
```

with ``g``/``w`` the WAN bytes of :func:`~expertmesh.planner.costmodel.replica_streams`
(tail / background), ``dense_ab = dense_params * grad_bytes`` on every ordered DC
pair and ``o`` = ``CostSettings.message_seconds`` (a pair term counts only when
the pair carries bytes).
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

__all__ = ["StepTime", "training_step_cost"]


@dataclass(frozen=True)
class StepTime:
    """A modeled training step (seconds) and its parts.

    ``layers``: [L] each layer's token chain (messages and compute included);
    ``compute``: the compute part of all chains; ``messages``: ``o`` times the phases
    that pay it (``4 L + 2``); ``gradient``/``refresh``: the two sync phases.
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
) -> StepTime:
    """Modeled seconds of one training step of every layer, run in sequence.

    - ``traffic``: per layer the step's token streams (``pair_crossings`` exact when known).
    - ``placements``: per layer the placement the step runs on (its replicas sync).
    - ``dense_params``: parameters outside the experts (data parallel); their gradient sum
      crosses every ordered DC pair once per step.

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
    num_dcs = topology.num_dcs
    grads = np.zeros((num_dcs, num_dcs))  # [D, D] bytes a -> b in the gradient phase
    fresh = np.zeros((num_dcs, num_dcs))  # [D, D] bytes a -> b in the refresh phase
    layers, compute, tokens = [], 0.0, 0.0
    for tr, placement in zip(traffic, placements, strict=True):
        cost = step_cost(topology, model, tr, None, settings)
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
    o = settings.message_seconds
    gradient = o + _link_phase(grads, topology)
    refresh = o + _link_phase(fresh, topology)
    return StepTime(
        seconds=float(sum(layers) + gradient + refresh),
        layers=layers,
        compute=compute,
        messages=o * settings.pipeline_chunks * 4 * len(layers) + 2 * o,
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
