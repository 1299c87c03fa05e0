"""GET /api/v1/dashboard: everything the web dashboard draws, in one poll (cached briefly)."""

from __future__ import annotations

import time
from typing import Annotated

import numpy as np
from fastapi import APIRouter, HTTPException, Query, Response

from expertmesh.controller.api import schemas as s
from expertmesh.controller.api import views
from expertmesh.controller.api.deps import AppState, StateDep
from expertmesh.planner import imbalance

router = APIRouter(prefix="/dashboard", tags=["dashboard"])

MAX_HEATMAP_LAYERS = 64
MAX_WORKERS = 1024
MAX_LINKS = 256
CACHE_SECONDS = 0.25


def build(state: AppState, layer: int) -> s.DashboardOut:
    core, tel = state.core, state.telemetry
    topo = core.topology
    committed = core.committed
    before = core.newest_rank_tokens(layer, static=True)
    after = core.newest_rank_tokens(layer)
    zeros = np.zeros(topo.num_ranks)
    before = zeros if before is None else before
    after = zeros if after is None else after
    cross = tel.cross_dc_totals()  # [2, D, D]
    names = [d.name for d in topo.dcs]
    pairs = []
    for a in range(topo.num_dcs):
        for b in range(a + 1, topo.num_dcs):
            tok = float(cross[0, a, b] + cross[0, b, a])
            wts = float(cross[1, a, b] + cross[1, b, a])
            pairs.append((tok + wts, a, b, tok, wts))
    pairs.sort(key=lambda p: -p[0])
    links = [
        s.DCLinkTrafficOut(
            src=names[a], dst=names[b], token_bytes=tok, weight_bytes=wts,
            gbps=float(topo.dc_gbps[a, b]),
        )
        for _, a, b, tok, wts in pairs[:MAX_LINKS]
    ]  # fmt: skip
    known = tel.workers()
    reported = core.last_reports()
    workers = [
        s.WorkerOut(
            rank=r,
            dc=names[int(topo.rank_dc[r])],
            up=known[r][0] if r in known else None,
            since=known[r][1] if r in known else None,
            last_report=None if np.isnan(reported[r]) else float(reported[r]),
        )
        for r in range(min(topo.num_ranks, MAX_WORKERS))
    ]
    steps = tel.steps()[-300:]
    events = tel.plan_events()[-100:]
    return s.DashboardOut(
        now=time.time(),
        plan_version=committed.version if committed else 0,
        policy=core.settings.policy,
        heatmap=views.heatmap(core)[:MAX_HEATMAP_LAYERS],
        rank_before=[float(x) for x in before],
        rank_after=[float(x) for x in after],
        imbalance_before=imbalance(before),
        imbalance_after=imbalance(after),
        layer_imbalance=tel.layer_imbalance(),
        runtime=bool(steps) or bool(known),
        steps=[s.StepOut(**vars(x)) for x in steps],
        balance=[views.balance_out(x) for x in tel.balance.records()[-300:]],
        plan_events=[s.PlanEventOut(**vars(x)) for x in events],
        plans=[views.summary_out(x) for x in state.store.summaries(limit=20)],
        dcs=views.dcs_out(topo),
        links=links,
        workers=workers,
        reports_received=core.reports_received,
        reports_rejected=core.reports_rejected,
    )


@router.get("", response_model=s.DashboardOut, summary="The dashboard's data, in one poll")
def dashboard(state: StateDep, layer: Annotated[int, Query(ge=0, le=4096)] = 0) -> Response:
    if layer >= state.core.model.num_layers:
        raise HTTPException(404, f"unknown layer {layer}")
    now = time.monotonic()
    cached = state.dashboard_cache.get(layer)
    if cached is not None and now - cached[0] < CACHE_SECONDS:
        return Response(cached[1], media_type="application/json")
    body = build(state, layer).model_dump_json().encode()
    state.dashboard_cache[layer] = (now, body)
    return Response(body, media_type="application/json")
