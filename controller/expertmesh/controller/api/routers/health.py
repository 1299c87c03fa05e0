"""Liveness and readiness."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from expertmesh.controller.api import schemas as s
from expertmesh.controller.api.deps import StateDep

router = APIRouter(tags=["health"])
log = logging.getLogger(__name__)


@router.get("/health", response_model=s.HealthOut, summary="The process serves requests")
async def health() -> s.HealthOut:
    return s.HealthOut(status="ok")


@router.get(
    "/ready",
    response_model=s.ReadyOut,
    summary="Ready to take traffic: plan store reachable, every surface up",
    responses={503: {"model": s.ReadyOut}},
)
def ready(state: StateDep) -> JSONResponse:
    checks: dict[str, bool] = {}
    try:
        state.store.count()
        checks["store"] = True
    except Exception:
        log.exception("plan store check failed")
        checks["store"] = False
    for name, check in state.ready_checks.items():
        try:
            checks[name] = bool(check())
        except Exception:
            log.exception("readiness check %s failed", name)
            checks[name] = False
    out = s.ReadyOut(ready=all(checks.values()), checks=checks)
    return JSONResponse(out.model_dump(), status_code=200 if out.ready else 503)
