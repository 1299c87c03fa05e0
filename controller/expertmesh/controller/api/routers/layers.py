"""GET /api/v1/layers: each layer's load window statistics."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path

from expertmesh.controller.api import schemas as s
from expertmesh.controller.api import views
from expertmesh.controller.api.deps import StateDep

router = APIRouter(prefix="/layers", tags=["layers"])

LayerPath = Annotated[int, Path(ge=0, le=4096, description="MoE layer index")]


@router.get("", response_model=s.LayersOut, summary="Every layer's load window statistics")
def list_layers(state: StateDep) -> s.LayersOut:
    core = state.core
    return s.LayersOut(
        layers=[views.layer_out(core.layer_stats(i)) for i in range(core.model.num_layers)]
    )


@router.get("/{layer}", response_model=s.LayerOut, summary="One layer's load window statistics")
def get_layer(state: StateDep, layer: LayerPath) -> s.LayerOut:
    core = state.core
    if layer >= core.model.num_layers:
        raise HTTPException(404, f"unknown layer {layer}; the model has {core.model.num_layers}")
    return views.layer_out(core.layer_stats(layer))
