"""hybrid's ``even_dcs`` (planner/dcfloor.py): candidate moves split by ``split_dcs`` with and
without the ``floor_bound`` skip, in one process on the same cases.

Each case: ``plan_hybrid`` with ``even_dcs`` and ``reserve_slots=1`` (the demo's fast-loop
settings) from static EP on a skewed estimate (gamma(0.3) expert popularity, 2,048
assignments per rank, top-2). Printed per mode: the CPU seconds of the solves, the
``split_dcs`` calls, and whether both modes give the same plans.

``.venv/bin/python bench/bench_even_dcs.py [--dcs 16] [--ranks-per-dc 4] [--cases 3]``
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

import expertmesh.planner.dcfloor as dcfloor
from expertmesh.planner import ModelSpec, Topology
from expertmesh.planner.hybrid import HybridSettings, plan_hybrid
from expertmesh.planner.plan import Placement
from expertmesh.planner.static import static_placement


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dcs", type=int, default=16)
    ap.add_argument("--ranks-per-dc", type=int, default=4)
    ap.add_argument("--cases", type=int, default=3)
    args = ap.parse_args()
    masters = 2
    topo = Topology.generate(args.dcs, args.ranks_per_dc, masters=masters, spare=2)
    topo = topo.with_inter_dc(1.0, 20.0)
    num_experts = topo.num_ranks * masters
    model = ModelSpec(num_experts=num_experts, top_k=2, hidden=32, ffn_hidden=64)
    base = static_placement(topo.num_ranks, topo.slots_per_rank, num_experts, masters)
    cfg = HybridSettings(reserve_slots=1, even_dcs=True)
    split, bound = dcfloor.split_dcs, dcfloor.floor_bound
    calls = [0]

    def counted(*a: Any, **kw: Any) -> Any:
        calls[0] += 1
        return split(*a, **kw)

    dcfloor.split_dcs = counted
    plans: dict[str, list[Placement]] = {}
    for mode in ("every move split", "floor_bound skip"):
        dcfloor.floor_bound = bound if mode == "floor_bound skip" else (lambda *a: -np.inf)
        calls[0], seconds, plans[mode] = 0, 0.0, []
        for seed in range(args.cases):
            rng = np.random.default_rng(seed)
            pop = rng.gamma(0.3, 1.0, num_experts)
            est = np.stack(
                [rng.multinomial(2048, pop / pop.sum()) for _ in range(topo.num_ranks)]
            ).astype(float)
            t0 = time.process_time()
            plans[mode].append(plan_hybrid(est, base, topo, model, cfg))
            seconds += time.process_time() - t0
        print(
            f"{mode}: {seconds:.2f} s CPU for {args.cases} solves at {args.dcs} DCs x "
            f"{args.ranks_per_dc} ranks, {num_experts} experts; split_dcs calls {calls[0]}"
        )
    a, b = plans.values()
    same = all(
        np.array_equal(x.phy2log, y.phy2log) and np.array_equal(x.master, y.master)
        for x, y in zip(a, b, strict=True)
    )
    print("same plans:", same)


if __name__ == "__main__":
    main()
