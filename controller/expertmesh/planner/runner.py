"""Run a policy over a whole trace: every step, every layer, with migrations.

``plan_trace`` is the one driver the CLI, the benchmark and the controller's
what-if solve share. It keeps, per layer, the history window the policy asks
for and the previous plan, aligns each new placement to the previous one so
copies that can stay do stay, and times the solve.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from expertmesh.planner.membership import expand_plan, live_mask, survivor_context
from expertmesh.planner.migration import align_placement, plan_migration
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import LayerPlan, Placement, check_trace
from expertmesh.planner.policy import Policy, PolicyContext
from expertmesh.planner.topology import Topology

__all__ = ["MIGRATION_COLUMNS", "TracePlan", "plan_layer", "plan_trace"]

MIGRATION_COLUMNS = (
    "step", "layer", "expert", "src_rank", "dst_rank", "dst_slot", "nbytes", "round", "is_master",
)  # fmt: skip


@dataclass(frozen=True, eq=False)
class TracePlan:
    """Plans for every step and layer: ``layers[t][l]``."""

    layers: list[list[LayerPlan]]

    @property
    def num_steps(self) -> int:
        return len(self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers[0]) if self.layers else 0

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The brief's plan format plus masters and migrations:

        ``phy2log`` int32 [T, L, R, S]; ``master`` int64 [T, L, E]; ``route`` int64 [N, 6]
        ``(step, layer, src_rank, expert, dst_rank, tokens)``; ``solve_seconds`` float64
        [T, L]; ``migration`` int64 [M, 9] (:data:`MIGRATION_COLUMNS`);
        ``migration_seconds`` float64 [T, L] (modeled).
        """
        phy2log = np.stack([np.stack([p.phy2log for p in row]) for row in self.layers])
        master = np.stack([np.stack([p.placement.master for p in row]) for row in self.layers])
        routes: list[np.ndarray] = []
        migs: list[tuple[int, ...]] = []
        for t, row in enumerate(self.layers):
            for layer, p in enumerate(row):
                r = np.empty((p.route.shape[0], 6), dtype=np.int64)
                r[:, 0], r[:, 1], r[:, 2:] = t, layer, p.route
                routes.append(r)
                migs.extend(
                    (t, layer, x.expert, x.src_rank, x.dst_rank, x.dst_slot, x.nbytes, x.round,
                     int(x.kind == "master"))
                    for x in p.migration.transfers
                )  # fmt: skip
        return {
            "phy2log": phy2log.astype(np.int32),
            "master": master.astype(np.int64),
            "route": np.concatenate(routes) if routes else np.zeros((0, 6), np.int64),
            "solve_seconds": np.array([[p.solve_seconds for p in row] for row in self.layers]),
            "migration": np.array(migs, dtype=np.int64).reshape(-1, len(MIGRATION_COLUMNS)),
            "migration_seconds": np.array(
                [[p.migration.seconds for p in row] for row in self.layers]
            ),
        }


def plan_layer(
    policy: Policy,
    ctx: PolicyContext,
    relabel_ranks: bool | None = None,
    *,
    origin: Placement | None = None,
) -> LayerPlan:
    """Place, align to the previous placement, route, and plan the migration for one layer.

    ``origin``: where the copies are when there is no previous plan (``ctx.previous`` is
    None), e.g. the static placement workers start from: the new placement is aligned to it
    and the migration moves from it; the policy itself does not see it (it plans as on a
    first step). Ignored when ``ctx.previous`` is set or ranks are dead.

    With ``ctx.dead_ranks`` the survivors plan (:mod:`expertmesh.planner.membership`) and the
    plan comes back over every rank, nothing on the dead ones."""
    if ctx.dead_ranks:
        sub = survivor_context(ctx, ctx.dead_ranks)
        lp = plan_layer(policy, sub, relabel_ranks)
        return expand_plan(lp, live_mask(ctx.topology.num_ranks, ctx.dead_ranks))
    t0 = time.perf_counter()
    placement = policy.place(ctx)
    base = ctx.previous.placement if ctx.previous is not None else origin
    if base is not None and placement is not base:
        relabel = (
            getattr(policy, "relabel_ranks", False) if relabel_ranks is None else relabel_ranks
        )
        placement = align_placement(base, placement, ctx.topology, relabel)
    route = policy.route(ctx, placement)
    solve = time.perf_counter() - t0
    if base is None or placement is base:
        return LayerPlan(placement=placement, route=route, solve_seconds=solve)
    migration = plan_migration(base, placement, ctx.topology, ctx.model)
    return LayerPlan(placement=placement, route=route, migration=migration, solve_seconds=solve)


def plan_trace(
    load: np.ndarray,
    topology: Topology,
    model: ModelSpec,
    policy: Policy,
    progress: Callable[[int], None] | None = None,
) -> TracePlan:
    """Plan trace ``load`` [T, L, R, E] step by step, layer by layer.

    ``progress``, if given, is called with the step index after each step is planned.
    """
    load = check_trace(load)
    num_steps, num_layers, num_ranks, num_experts = load.shape
    if num_ranks != topology.num_ranks:
        raise ValueError(f"trace has {num_ranks} ranks, the topology has {topology.num_ranks}")
    if num_experts != model.num_experts:
        raise ValueError(f"trace has {num_experts} experts, the model has {model.num_experts}")
    window = policy.history_window()
    out: list[list[LayerPlan]] = []
    prev: list[LayerPlan | None] = [None] * num_layers
    for t in range(num_steps):
        row = []
        for layer in range(num_layers):
            ctx = PolicyContext(
                topology=topology,
                model=model,
                step=t,
                layer=layer,
                load=load[t, layer],
                history=load[max(0, t - window) : t, layer],
                previous=prev[layer],
            )
            plan = plan_layer(policy, ctx)
            prev[layer] = plan
            row.append(plan)
        out.append(row)
        if progress is not None:
            progress(t)
    return TracePlan(layers=out)
