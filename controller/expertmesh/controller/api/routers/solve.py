"""POST /api/v1/solve: a what-if plan for a load and a policy. Nothing is applied."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, HTTPException

from expertmesh.controller.api import schemas as s
from expertmesh.controller.api import views
from expertmesh.controller.api.deps import StateDep

router = APIRouter(prefix="/solve", tags=["solve"])


@router.post(
    "",
    response_model=s.SolveOut,
    summary="Plan a load with a policy (what-if; changes nothing)",
    responses={422: {"model": s.ErrorOut}},
)
def solve(state: StateDep, body: s.SolveIn) -> s.SolveOut:
    core = state.core
    if body.layer >= core.model.num_layers:
        raise HTTPException(
            404, f"unknown layer {body.layer}; the model has {core.model.num_layers}"
        )
    want = (core.topology.num_ranks, core.model.num_experts)
    if len(body.load) != want[0] or any(len(row) != want[1] for row in body.load):
        raise HTTPException(422, f"load must be [{want[0]}, {want[1]}] (ranks x experts)")
    load = np.array(body.load, dtype=np.int64).reshape(want)
    try:
        lp, before, after = core.what_if(
            load,
            layer=body.layer,
            policy=body.policy,
            policy_settings=body.policy_settings,
            from_committed=body.from_committed,
        )
    except ValueError as err:
        raise HTTPException(422, str(err)) from None
    return s.SolveOut(
        policy=body.policy or core.settings.policy,
        imbalance_before=before,
        imbalance_after=after,
        plan=views.layer_plan_out(body.layer, lp, core.model.num_experts, route=True),
    )
