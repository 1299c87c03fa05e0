"""The planner's level beside the measured imbalance (``RuntimeSettings.planner_level``): the
controller solves the planner's split by DC and quota on every step's exact counts under
the plan the step ran; the ranks compute what that solve says. Real local Ray, real gloo,
the fast loop on, hybrid evening out its DCs (``even_dcs``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from expertmesh.controller.core import Trigger
from expertmesh.formats import read_plan, read_trace
from expertmesh.planner import Placement, Topology
from expertmesh.planner.fastquota import DEFAULTS
from expertmesh.runtime import stepstats
from expertmesh.runtime.settings import RuntimeSettings
from expertmesh.runtime.spmd import SpmdRuntime
from expertmesh.workers.model import LMConfig

pytestmark = pytest.mark.integration

LM = LMConfig(num_layers=2, num_experts=12, top_k=2, hidden=16, ffn_hidden=16, batch=4, seq_len=32)
STEPS = 6


def test_the_planner_level_is_solved_on_each_steps_counts_and_the_ranks_reach_it(
    tmp_path: Path,
) -> None:
    # 2 DCs x 3 ranks, 2 masters + 2 spare: a DC holds 9 of 12 experts (one slot per rank
    # stays free for the fast loop)
    topo = Topology.generate(2, 3, masters=2, spare=2).with_inter_dc(1.0, 2.0)
    settings = RuntimeSettings(
        topology=topo.to_dict(), lm=LM, policy="hybrid", trigger=Trigger(mode="every_n", every=2),
        policy_settings={"reserve_slots": 1, "even_dcs": True, "period": 2, "window": 1},
        corpus_bytes=200_000, trace_dir=str(tmp_path), planner_level=True,
    )  # fmt: skip
    with SpmdRuntime(settings) as rt:
        steps = rt.train(STEPS)
    trace, plans = read_trace(tmp_path / "trace.npz"), read_plan(tmp_path / "plans.npz")
    rank_dc = np.asarray(topo.rank_dc)
    cost = np.where(np.eye(2, dtype=bool), 0.0, 8.0 / (topo.dc_gbps * 1e9))
    assert len({s.plan_version for s in steps}) > 1  # plans switched in
    for i, s in enumerate(steps):
        placements = [Placement(plans.phy2log[i, x], plans.master[i, x]) for x in range(2)]
        counts = trace.load[i][None]  # one microbatch a step: the step's counts [1, L, R, E]
        # the controller's grid is the solve on the counts every rank reported, under the
        # plan the step ran: the same offline from the run's trace and plans
        assert s.imbalance_planner_microbatches == stepstats.planner_level(
            counts, placements, rank_dc, cost
        )
        assert s.imbalance_planner == max(max(r) for r in s.imbalance_planner_microbatches)
        # what the ranks computed is the fast loop's solve of the same counts (the replica
        # economy's defaults instead of the planner's exact rule): rank by rank
        assert _per_rank(counts, placements, rank_dc, cost) == s.tokens_per_layer_rank
        assert s.imbalance_planner == pytest.approx(s.imbalance, abs=0.03)


def _per_rank(counts, placements, rank_dc, cost):
    """[L][R] tokens per rank of the workers' solve: the split by DC, then in each DC quota
    with the replica economy's defaults and the chains (workers/balance.py)."""
    from expertmesh.planner.dcsplit import split_dcs
    from expertmesh.workers.balance import DomainBase, solve
    from expertmesh.workers.moe import relay_counts

    out = []
    for layer, p in enumerate(placements):
        dcs = [np.flatnonzero(rank_dc == d) for d in range(2)]
        holds = np.stack([p.holds()[m].any(axis=0) for m in dcs])
        split = split_dcs(counts[0, layer], holds, rank_dc, cost)
        per = np.zeros(rank_dc.size, np.int64)
        for d, ranks in enumerate(dcs):
            sol = solve(relay_counts(split.tokens, d, rank_dc), DomainBase.of(p, ranks),
                        settings=DEFAULTS)  # fmt: skip
            per[ranks] = np.bincount(sol.route[:, 2], weights=sol.route[:, 3], minlength=3)
        out.append(per.tolist())
    return out
