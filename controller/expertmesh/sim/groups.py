"""Data-parallel EP groups: the sound way to run many DCs when there are fewer experts than slots.

With ``E`` experts and ``masters`` master slots per rank, expert parallelism needs
``E / masters`` ranks; a job on more ranks than that runs *EP groups* of that size, each
holding every expert once, data-parallel with each other (the usual EP x DP layout).
Planning one placement of ``E`` experts over every rank of 1,000 DCs instead leaves most
ranks without an expert under static EP, a baseline no one would run.

A world of ``D`` DCs is ``G = D / group_dcs`` groups of ``group_dcs`` consecutive DCs. A
group's tokens go only to its own copies, and every DC pair is its own link
(docs/cost-model.md), so groups share no link: each group is simulated on its own
topology with its own trace (seed ``seed + g``), every policy on it as on any topology.
The world's step waits for its slowest group (synchronous data parallelism):

```
T_world(t) = max_g T_g(t) + T_dp
T_dp       = (2 * M * P * grad_bytes / B_wan + 2 * ceil(log2 G) * L_wan) / m   (G > 1)
```

``T_dp`` is the all-reduce of expert gradients across groups once per optimizer update
(``m`` microbatches): a pipelined reduce and broadcast tree over the WAN pairs (the relay
model of ``replica_streams``), ``M`` the most masters one DC holds under static EP. It is
the same for every policy (a policy that moves masters between DCs is charged static's
layout). Columns: seconds as above; imbalance the largest group's (every rank computes
the same mean); bytes, replicas and solve seconds summed over groups; exposed seconds
and the bottleneck those of the slowest group.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from expertmesh.planner.costmodel import CostSettings
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.topology import Topology
from expertmesh.sim.engine import LoadSource, PolicyRun, SimResult, StepRow, simulate

__all__ = ["auto_group_dcs", "dp_seconds", "simulate_groups"]


def auto_group_dcs(num_dcs: int, ranks_per_dc: int, num_experts: int, masters: int) -> int:
    """DCs per EP group: the fewest DCs whose ranks hold every expert in master slots
    (``ceil(E / (masters * ranks_per_dc))``), when that is fewer than ``num_dcs`` and divides
    it; else ``num_dcs`` (one group: every DC plans together)."""
    if min(num_dcs, ranks_per_dc, num_experts, masters) < 1:
        raise ValueError("DCs, ranks per DC, experts and master slots must be >= 1")
    need = math.ceil(num_experts / (masters * ranks_per_dc))
    if need < num_dcs and num_dcs % need == 0:
        return need
    return num_dcs


def dp_seconds(group: Topology, num_groups: int, model: ModelSpec, cost: CostSettings) -> float:
    """``T_dp`` of the module doc: seconds per microbatch of the cross-group all-reduce of
    expert gradients (0 for one group or forward-only)."""
    if num_groups <= 1 or not model.training:
        return 0.0
    per_rank = np.bincount(
        (np.arange(model.num_experts) * group.num_ranks) // model.num_experts,
        minlength=group.num_ranks,
    )  # static EP's masters per rank
    per_dc = np.bincount(group.rank_dc, weights=per_rank, minlength=group.num_dcs)
    nbytes = float(per_dc.max()) * model.expert_params * model.grad_bytes
    link = group.inter_dc
    depth = math.ceil(math.log2(num_groups))
    t = 2.0 * nbytes / link.bytes_per_second + 2.0 * depth * link.latency_s
    return t / cost.microbatches_per_update


def simulate_groups(
    group: Topology,
    num_groups: int,
    trace: Callable[[int], LoadSource],
    model: ModelSpec,
    policies: list[str],
    *,
    policy_settings: dict[str, dict[str, object]] | None = None,
    cost: CostSettings | None = None,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Every policy on ``num_groups`` EP groups of topology ``group`` (``trace(g)``: the
    loads of group ``g``), combined into one world run (module doc)."""
    if num_groups < 1:
        raise ValueError("num_groups must be >= 1")
    cost = cost or CostSettings()
    dp = dp_seconds(group, num_groups, model, cost)
    results = []
    wall = 0.0
    for g in range(num_groups):
        res = simulate(
            trace(g), group, model, policies,
            policy_settings=policy_settings, cost=cost, progress=progress,
        )  # fmt: skip
        wall += res.wall_seconds
        results.append(res)
    runs = []
    for i, name in enumerate(policies):
        parts = [r.runs[i] for r in results]
        skipped = next((p.skipped for p in parts if p.skipped is not None), None)
        if skipped is not None:
            runs.append(PolicyRun(name, skipped=skipped))
            continue
        steps = min(len(p.rows) for p in parts)
        rows = [_combine([p.rows[t] for p in parts], dp) for t in range(steps)]
        cost_parts = {k: sum(p.cost_parts[k] for p in parts) for k in parts[0].cost_parts}
        runs.append(
            PolicyRun(
                name, rows=rows, cpu_seconds=sum(p.cpu_seconds for p in parts),
                cost_parts=cost_parts,
            )
        )  # fmt: skip
    return SimResult(runs, wall, num_groups=num_groups, dp_seconds=dp)


def _combine(rows: list[StepRow], dp: float) -> StepRow:
    """One world row from the rows of every group at one step."""
    slow = int(np.argmax([r.seconds for r in rows]))
    where = f"group {slow}: {rows[slow].bottleneck}" if len(rows) > 1 else rows[slow].bottleneck
    return StepRow(
        policy=rows[0].policy,
        step=rows[0].step,
        seconds=rows[slow].seconds + dp,
        imbalance=max(r.imbalance for r in rows),
        cross_dc_token_bytes=sum(r.cross_dc_token_bytes for r in rows),
        cross_dc_weight_bytes=sum(r.cross_dc_weight_bytes for r in rows),
        migration_bytes=sum(r.migration_bytes for r in rows),
        replicas=sum(r.replicas for r in rows),
        solve_seconds=sum(r.solve_seconds for r in rows),
        exposed_seconds=rows[slow].exposed_seconds,
        bottleneck=where,
    )
