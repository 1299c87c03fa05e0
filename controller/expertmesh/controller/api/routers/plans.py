"""Plans: paginated history (from the plan store), latest, by version, per layer, diffs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, HTTPException, Path, Query, Response

from expertmesh.controller.api import schemas as s
from expertmesh.controller.api import views
from expertmesh.controller.api.deps import AppState, StateDep
from expertmesh.controller.core import PlanState, PlanVersion
from expertmesh.engines.files import export_bytes
from expertmesh.engines.placement import EngineLayout, ExportError

router = APIRouter(prefix="/plans", tags=["plans"])

VersionPath = Annotated[int, Path(ge=1, le=2**62, description="plan version")]
LayerPath = Annotated[int, Path(ge=0, le=4096, description="MoE layer index")]
PLAN_CACHE_BYTES = 64 << 20  # rendered plan JSON kept per app
WithRoute = Annotated[bool, Query(description="include each layer's [N, 4] route")]


def plan_json(state: AppState, pv: PlanVersion, route: bool) -> bytes:
    """The JSON body of ``pv`` (``PlanOut``). Committed (and rolled back) plans never change:
    their body is rendered once and kept (bounded in entries and bytes: a plan with its
    routes can be tens of MB)."""
    key = (pv.version, route)
    final = pv.state != PlanState.PREPARED
    if final:
        with state.plan_json_lock:
            body = state.plan_json.get(key)
        if body is not None:
            return body
    out = views.plan_out(pv, state.core.model.num_experts, route=route)
    body = out.model_dump_json().encode()
    if final and len(body) <= PLAN_CACHE_BYTES // 4:
        with state.plan_json_lock:
            cache = state.plan_json
            cache[key] = body
            while len(cache) > 64 or sum(map(len, cache.values())) > PLAN_CACHE_BYTES:
                cache.pop(next(iter(cache)))
    return body


def prerender_on_commit(state: AppState) -> Callable[[str, PlanVersion], None]:
    """A core listener: when a plan commits, render its ``/plans/latest`` body in a thread
    of its own, so no request waits for it (listeners run under the core's lock)."""

    def on_plan(event: str, pv: PlanVersion) -> None:
        if event == "committed":
            threading.Thread(
                target=plan_json, args=(state, pv, False), name="expertmesh-render", daemon=True
            ).start()

    return on_plan


def _plan_response(state: AppState, pv: PlanVersion, route: bool) -> Response:
    return Response(plan_json(state, pv, route), media_type="application/json")


@router.get("", response_model=s.PlansPage, summary="Committed plans, newest first")
def list_plans(
    state: StateDep,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 50,
) -> s.PlansPage:
    limit = min(limit, state.settings.max_page)
    items = state.store.summaries(offset=offset, limit=limit)
    return s.PlansPage(
        items=[views.summary_out(x) for x in items],
        total=state.store.count(),
        offset=offset,
        limit=limit,
    )


@router.get("/latest", response_model=s.PlanOut, summary="The committed plan")
async def latest_plan(state: StateDep, route: WithRoute = False) -> Response:
    pv = state.core.committed
    if pv is None:
        raise HTTPException(404, "no plan has been committed yet")
    return _plan_response(state, pv, route)


@router.get("/diff", response_model=s.PlanDiffOut, summary="What changed between two versions")
def diff_plans(
    state: StateDep,
    from_version: Annotated[int, Query(alias="from", ge=1, le=2**62)],
    to_version: Annotated[int, Query(alias="to", ge=1, le=2**62)],
) -> s.PlanDiffOut:
    old, new = state.find_plan(from_version), state.find_plan(to_version)
    try:
        return views.diff_out(old, new, state.core.topology, state.core.model)
    except ValueError as err:
        raise HTTPException(422, str(err)) from None


@router.get("/{version}", response_model=s.PlanOut, summary="One plan by version")
def get_plan(state: StateDep, version: VersionPath, route: WithRoute = False) -> Response:
    return _plan_response(state, state.find_plan(version), route)


@router.get(
    "/{version}/layers/{layer}", response_model=s.LayerPlanOut, summary="One layer of a plan"
)
def get_plan_layer(
    state: StateDep, version: VersionPath, layer: LayerPath, route: WithRoute = True
) -> s.LayerPlanOut:
    pv = state.find_plan(version)
    if layer >= len(pv.layers):
        raise HTTPException(404, f"unknown layer {layer}; plan {version} has {len(pv.layers)}")
    return views.layer_plan_out(layer, pv.layers[layer], state.core.model.num_experts, route=route)


_EXPORT_MEDIA = {
    "sglang": "application/json",
    "vllm": "application/json",
    "trtllm": "application/yaml",
}
_EXPORT_SUFFIX = {"sglang": "json", "vllm": "json", "trtllm": "yaml"}


@router.get(
    "/{version}/export",
    response_model=s.SglangPlacementOut | s.VllmPlacementOut,
    summary="A plan as an engine's expert placement file",
    description="`sglang`: the `--init-expert-location` JSON; `vllm`: its EPLB maps (JSON); "
    "`trtllm`: the MoE load balancer YAML. 422 when the engine cannot express the plan "
    "(empty slots, an expert without a copy). docs/engines.md.",
    responses={
        200: {"content": {"application/yaml": {"schema": s.TrtllmPlacementOut.model_json_schema()}}}
    },
)
def export_plan(
    state: StateDep,
    version: VersionPath,
    *,
    format: Annotated[Literal["sglang", "trtllm", "vllm"], Query(description="the engine")],
    layer_offset: Annotated[
        int, Query(ge=0, le=4096, description="engine layer of MoE layer 0 (dense layers first)")
    ] = 0,
    num_model_layers: Annotated[
        int | None, Query(ge=1, le=8192, description="sglang: the model's num_hidden_layers")
    ] = None,
    layer_updates_per_iter: Annotated[int, Query(ge=0, le=4096, description="trtllm")] = 0,
) -> Response:
    pv = state.find_plan(version)
    phy2log = np.stack([lp.phy2log for lp in pv.layers])  # [L, R, S]
    try:
        layout = EngineLayout.make(
            len(pv.layers), layer_offset=layer_offset, num_model_layers=num_model_layers
        )
        body = export_bytes(
            phy2log, state.core.model.num_experts, format, layout,
            suffix=f".{_EXPORT_SUFFIX[format]}", layer_updates_per_iter=layer_updates_per_iter,
        )  # fmt: skip
    except ExportError as err:
        raise HTTPException(422, f"plan {version} cannot be written for {format}: {err}") from None
    name = f"expertmesh-plan-{version}-{format}.{_EXPORT_SUFFIX[format]}"
    return Response(
        body,
        media_type=_EXPORT_MEDIA[format],
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )
