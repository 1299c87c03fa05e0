"""Load report ingestion over REST (the gRPC stream is the fast path)."""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter, HTTPException

from expertmesh.controller.api import schemas as s
from expertmesh.controller.api.deps import IngestDep, StateDep

router = APIRouter(prefix="/reports", tags=["reports"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": s.ErrorOut},
    413: {"model": s.ErrorOut},
    422: {"model": s.ErrorOut},
}


@router.post("", response_model=s.ReportOut, summary="One rank's [E] load", responses=_ERRORS)
def report(state: StateDep, body: s.ReportIn, _auth: IngestDep) -> s.ReportOut:
    core = state.core
    try:
        complete = core.report_load(body.step, body.layer, body.rank, np.array(body.load, np.int64))
    except ValueError as err:  # counted as rejected by the core
        raise HTTPException(422, str(err)) from None
    return s.ReportOut(
        accepted=True,
        complete=complete,
        received=core.reports_received,
        rejected=core.reports_rejected,
    )


@router.post("/layer", response_model=s.ReportOut, summary="A whole [R, E] load", responses=_ERRORS)
def report_layer(state: StateDep, body: s.LayerReportIn, _auth: IngestDep) -> s.ReportOut:
    core = state.core
    want = (core.topology.num_ranks, core.model.num_experts)
    if len(body.load) != want[0] or any(len(row) != want[1] for row in body.load):
        core.reject_report()
        raise HTTPException(422, f"load must be [{want[0]}, {want[1]}] (ranks x experts)")
    try:
        core.report_layer(body.step, body.layer, np.array(body.load, np.int64).reshape(want))
    except ValueError as err:
        raise HTTPException(422, str(err)) from None
    return s.ReportOut(
        accepted=True,
        complete=True,
        received=core.reports_received,
        rejected=core.reports_rejected,
    )
