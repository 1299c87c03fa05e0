"""What a plan does to its trace: balance, migration traffic, cross-DC bytes, modeled time.

:func:`summarize_plan` reads the arrays of the plan format
(:meth:`~expertmesh.planner.runner.TracePlan.to_arrays`) and the trace they
route, and returns per step and layer figures. Token and weight bytes across
DCs and the modeled step time come from the cost model
(:func:`~expertmesh.planner.costmodel.step_cost`, docs/cost-model.md), so they
agree with the simulator and the runtime's predictions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from expertmesh.planner.costmodel import (
    CostSettings,
    ExpertStreams,
    migration_streams,
    replica_streams,
    step_cost,
)
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import Placement
from expertmesh.planner.topology import Topology
from expertmesh.planner.trace import static_imbalance
from expertmesh.planner.traffic import traffic_from_route

__all__ = ["PlanSummary", "summarize_plan"]


@dataclass(frozen=True, eq=False)
class PlanSummary:
    """Per step and layer figures, every array [T, L].

    - ``imbalance``, ``straggler``: max/mean and max - mean of tokens per rank under the plan.
    - ``static_imbalance``: max/mean of the same load under static EP (the "before").
    - ``solve_seconds``: planner time; ``step_seconds``: modeled time of the layer's step.
    - ``copies``, ``migrated_bytes``: expert transfers into this step's placement (relay hops
      count each) and their bytes.
    - ``cross_dc_token_bytes``: token bytes over DC pairs in the step (dispatch and combine,
      forward and backward when training; hierarchical dispatch estimated by the cost model).
    - ``cross_dc_weight_bytes``: expert bytes over DC pairs: migrations into this placement
      plus, when training, replica weight refresh and gradient return.
    """

    imbalance: np.ndarray
    straggler: np.ndarray
    static_imbalance: np.ndarray
    solve_seconds: np.ndarray
    step_seconds: np.ndarray
    copies: np.ndarray
    migrated_bytes: np.ndarray
    cross_dc_token_bytes: np.ndarray
    cross_dc_weight_bytes: np.ndarray

    @property
    def cross_dc_bytes(self) -> np.ndarray:
        return self.cross_dc_token_bytes + self.cross_dc_weight_bytes


def _masters(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """[E] flat slot of the first copy of each expert (a master when a file has none)."""
    flat = phy2log.ravel()
    slots = np.flatnonzero(flat >= 0)
    experts = flat[slots]
    first = np.full(num_experts, -1, dtype=np.int64)
    uniq, idx = np.unique(experts, return_index=True)
    first[uniq] = slots[idx]
    return first


def summarize_plan(
    arrays: Mapping[str, np.ndarray],
    load: np.ndarray,
    topology: Topology,
    model: ModelSpec,
    settings: CostSettings | None = None,
) -> PlanSummary:
    """Figures of plan ``arrays`` over trace ``load`` [T, L, R, E].

    ``arrays``: ``phy2log`` [T, L, R, S], ``route`` [N, 6], ``solve_seconds`` [T, L] and
    optionally ``master`` [T, L, E] (else each expert's first copy stands in) and
    ``migration`` [M, 9]. The plan must route ``load`` (see ``formats.validate_plan``).
    """
    phy2log = np.asarray(arrays["phy2log"])
    route = np.asarray(arrays["route"], dtype=np.int64)
    num_steps, num_layers, num_ranks, _ = phy2log.shape
    if load.shape[:3] != (num_steps, num_layers, num_ranks):
        raise ValueError(f"plan is [{num_steps}, {num_layers}, {num_ranks}, S], load {load.shape}")
    if num_ranks != topology.num_ranks:
        raise ValueError(f"plan has {num_ranks} ranks, the topology {topology.num_ranks}")
    num_experts = load.shape[3]
    cells = num_steps * num_layers
    key = route[:, 0] * num_layers + route[:, 1]  # [N] cell of each row
    if key.size and (np.diff(key) < 0).any():  # plan_trace writes rows in cell order
        order = np.argsort(key, kind="stable")
        route, key = route[order], key[order]
    bounds = np.searchsorted(key, np.arange(cells + 1))  # [T*L + 1]

    rank_tokens = np.bincount(
        key * num_ranks + route[:, 4], weights=route[:, 5], minlength=cells * num_ranks
    ).reshape(num_steps, num_layers, num_ranks)
    mean = rank_tokens.mean(axis=2)
    peak = rank_tokens.max(axis=2)
    imb = np.where(mean > 0, peak / np.where(mean > 0, mean, 1.0), 1.0)

    mig = np.asarray(arrays.get("migration", np.zeros((0, 9), np.int64)), dtype=np.int64)
    mkey = mig[:, 0] * num_layers + mig[:, 1]
    if mkey.size and (np.diff(mkey) < 0).any():
        morder = np.argsort(mkey, kind="stable")
        mig, mkey = mig[morder], mkey[morder]
    mbounds = np.searchsorted(mkey, np.arange(cells + 1))
    copies = np.bincount(mkey, minlength=cells).reshape(num_steps, num_layers)
    moved = np.bincount(mkey, weights=mig[:, 6], minlength=cells).reshape(num_steps, num_layers)

    master = arrays.get("master")
    step_s = np.zeros((num_steps, num_layers))
    tok_b = np.zeros((num_steps, num_layers))
    wt_b = np.zeros((num_steps, num_layers))
    settings = settings or CostSettings()
    for t in range(num_steps):
        for layer in range(num_layers):
            c = t * num_layers + layer
            p2l = phy2log[t, layer]
            m = master[t, layer] if master is not None else _masters(p2l, num_experts)
            placement = Placement(phy2log=p2l, master=np.asarray(m, dtype=np.int64))
            rows = route[bounds[c] : bounds[c + 1], 2:]  # [n, 4]
            traffic = traffic_from_route(rows, load[t, layer], topology, model.top_k)
            streams: ExpertStreams = replica_streams(placement, topology, model, settings)
            x = mig[mbounds[c] : mbounds[c + 1]]
            if x.size:
                streams = streams + migration_streams(x[:, 3], x[:, 4], x[:, 6], topology)
            cost = step_cost(topology, model, traffic, streams, settings)
            step_s[t, layer] = cost.seconds
            tok_b[t, layer] = cost.cross_dc_token_bytes
            wt_b[t, layer] = cost.cross_dc_weight_bytes
    return PlanSummary(
        imbalance=imb,
        straggler=peak - mean,
        static_imbalance=static_imbalance(load),
        solve_seconds=np.asarray(arrays["solve_seconds"], dtype=np.float64),
        step_seconds=step_s,
        copies=copies.astype(np.int64),
        migrated_bytes=moved,
        cross_dc_token_bytes=tok_b,
        cross_dc_weight_bytes=wt_b,
    )
