"""Domain objects -> REST response models. Pure functions (no FastAPI)."""

from __future__ import annotations

import numpy as np

from expertmesh.controller.api import schemas as s
from expertmesh.controller.balance import BalanceRecord
from expertmesh.controller.core import ControllerCore, LayerStats, PlanVersion
from expertmesh.controller.store import PlanSummary, summarize
from expertmesh.planner import LayerPlan, Link, ModelSpec, Topology, imbalance
from expertmesh.planner.migration import plan_migration
from expertmesh.planner.plan import Migration, Transfer


def _link(a: str, b: str, lk: Link) -> s.LinkOut:
    return s.LinkOut(a=a, b=b, gbps=lk.gbps, latency_ms=lk.latency_ms)


def dcs_out(topo: Topology) -> list[s.DCOut]:
    return [
        s.DCOut(
            name=d.name,
            index=i,
            nodes=d.nodes,
            ranks_per_node=d.ranks_per_node,
            first_rank=int(topo.dc_ranks[i][0]),
            num_ranks=d.num_ranks,
        )
        for i, d in enumerate(topo.dcs)
    ]


def topology_out(topo: Topology, model: ModelSpec, max_pairs: int = 10_000) -> s.TopologyOut:
    names = [d.name for d in topo.dcs]
    pairs = [
        _link(names[a], names[b], topo.dc_link(a, b))
        for a in range(topo.num_dcs)
        for b in range(a + 1, topo.num_dcs)
    ][:max_pairs]
    return s.TopologyOut(
        dcs=dcs_out(topo),
        num_ranks=topo.num_ranks,
        masters_per_rank=topo.masters_per_rank,
        spare_per_rank=topo.spare_per_rank,
        slots_per_rank=topo.slots_per_rank,
        intra_node=_link("*", "*", topo.intra_node),
        intra_dc=_link("*", "*", topo.intra_dc),
        inter_dc=_link("*", "*", topo.inter_dc),
        dc_links=pairs,
        model=s.ModelOut(
            num_layers=model.num_layers,
            num_experts=model.num_experts,
            top_k=model.top_k,
            hidden=model.hidden,
            ffn_hidden=model.ffn_hidden,
            expert_bytes=model.expert_bytes,
        ),
    )


def layer_out(st: LayerStats) -> s.LayerOut:
    return s.LayerOut(
        layer=st.layer,
        loads=st.loads,
        newest_step=st.newest_step,
        imbalance=st.imbalance,
        balancedness=1.0 / st.imbalance if st.imbalance > 0 else 0.0,
        expert_load=[float(x) for x in st.expert_load],
        rank_load=[float(x) for x in st.rank_load],
    )


def balance_out(rec: BalanceRecord) -> s.BalanceStepOut:
    names = ("microbatches", "within_dc", "floor", "planner")
    grids = {k: [list(r) for r in getattr(rec, k)] for k in names}
    level = max(max(r) for r in rec.planner) if rec.planner else None
    return s.BalanceStepOut(
        **{**vars(rec), "balancedness": list(rec.balancedness), **grids},
        imbalance_planner=level,
    )


def summary_out(sm: PlanSummary) -> s.PlanSummaryOut:
    return s.PlanSummaryOut.model_validate(sm.model_dump())


def transfers_out(transfers: tuple[Transfer, ...]) -> list[s.TransferOut]:
    return [
        s.TransferOut(
            expert=t.expert,
            src_rank=t.src_rank,
            dst_rank=t.dst_rank,
            dst_slot=t.dst_slot,
            nbytes=t.nbytes,
            round=t.round,
            kind=str(t.kind),
        )
        for t in transfers
    ]


def layer_plan_out(
    layer: int, lp: LayerPlan, num_experts: int, *, route: bool = False
) -> s.LayerPlanOut:
    tokens = lp.rank_tokens()
    return s.LayerPlanOut(
        layer=layer,
        phy2log=lp.phy2log.astype(int).tolist(),
        master=lp.placement.master.astype(int).tolist(),
        logcnt=lp.placement.logcnt(num_experts).astype(int).tolist(),
        rank_tokens=tokens.astype(int).tolist(),
        imbalance=imbalance(tokens),
        solve_seconds=float(lp.solve_seconds),
        migrations=transfers_out(lp.migration.transfers),
        migration_seconds=lp.migration.seconds,
        route=np.asarray(lp.route, np.int64).tolist() if route else None,
    )


def plan_out(pv: PlanVersion, num_experts: int, *, route: bool = False) -> s.PlanOut:
    base = summary_out(summarize(pv)).model_dump()
    layers = [layer_plan_out(i, lp, num_experts, route=route) for i, lp in enumerate(pv.layers)]
    return s.PlanOut(**base, layers=layers)


def diff_out(old: PlanVersion, new: PlanVersion, topo: Topology, model: ModelSpec) -> s.PlanDiffOut:
    """Slots that changed between two versions and the migrations that turn ``old``'s
    placement into ``new``'s (computed by the planner's migration, nothing applied)."""
    if len(old.layers) != len(new.layers):
        raise ValueError("the two plans have different numbers of layers")
    layers = []
    for i, (a, b) in enumerate(zip(old.layers, new.layers, strict=True)):
        if a.phy2log.shape != b.phy2log.shape:
            raise ValueError(f"layer {i}: the two plans have different slot shapes")
        r_idx, s_idx = np.nonzero(a.phy2log != b.phy2log)
        changes = [
            s.SlotChangeOut(
                rank=int(r), slot=int(sl), before=int(a.phy2log[r, sl]), after=int(b.phy2log[r, sl])
            )
            for r, sl in zip(r_idx, s_idx, strict=True)
        ]
        mig: Migration = (
            plan_migration(a.placement, b.placement, topo, model) if changes else Migration()
        )
        layers.append(
            s.LayerDiffOut(
                layer=i,
                changed_slots=changes,
                migrations=transfers_out(mig.transfers),
                migration_bytes=mig.nbytes,
                imbalance_before=float(old.imbalance_after[i]),
                imbalance_after=float(new.imbalance_after[i]),
            )
        )
    return s.PlanDiffOut(
        from_version=old.version,
        to_version=new.version,
        layers=layers,
        changed_slots=sum(len(x.changed_slots) for x in layers),
        migrations=sum(len(x.migrations) for x in layers),
        migration_bytes=sum(x.migration_bytes for x in layers),
    )


def heatmap(core: ControllerCore) -> list[list[float]]:
    """[L, E] mean tokens per expert over each layer's window."""
    return [
        [round(float(x), 2) for x in core.layer_stats(layer).expert_load]
        for layer in range(core.model.num_layers)
    ]
