"""GET /api/v1/balance: the measured balance of recent SPMD steps (the fast loop's work)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from expertmesh.controller.api import schemas as s
from expertmesh.controller.api import views
from expertmesh.controller.api.deps import StateDep

router = APIRouter(prefix="/balance", tags=["balance"])

MAX_STEP = 2**62


@router.get(
    "",
    response_model=s.BalanceOut,
    summary="Measured imbalance, static EP's, per-layer balancedness and fast-loop cost per step",
)
def get_balance(
    state: StateDep,
    since: Annotated[int, Query(ge=0, le=MAX_STEP, description="first step to return")] = 0,
    limit: Annotated[int, Query(ge=1, le=100_000, description="newest steps at most")] = 1000,
) -> s.BalanceOut:
    tel = state.telemetry
    records = tel.balance.records(since)[-limit:]
    return s.BalanceOut(
        steps=[views.balance_out(r) for r in records],
        num_layers=tel.balance.num_layers,
        history=tel.settings.history,
    )
