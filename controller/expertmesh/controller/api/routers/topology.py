"""GET /api/v1/topology: DCs, ranks, slots, links and the model."""

from __future__ import annotations

from fastapi import APIRouter

from expertmesh.controller.api import schemas as s
from expertmesh.controller.api import views
from expertmesh.controller.api.deps import StateDep

router = APIRouter(prefix="/topology", tags=["topology"])


@router.get("", response_model=s.TopologyOut, summary="The topology and the model")
def get_topology(state: StateDep) -> s.TopologyOut:
    return views.topology_out(state.core.topology, state.core.model)
