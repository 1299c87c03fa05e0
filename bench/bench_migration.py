"""Migration benchmark: copies kept, rounds, modeled time and planner speed, EP64 to 8,000 ranks.

Scenarios (old -> new placement, 4 masters + 2 spare slots per rank):

- ``spare``: masters fixed (static EP), every spare slot refilled with random hot experts
  (10% of experts), old and new drawn independently: what ``quota`` re-plans every
  microbatch.
- ``shuffled``: the same placement with the contents of whole nodes and of ranks inside
  nodes permuted (what a rank-blind policy such as EPLB may return); alignment with
  ``relabel_ranks`` recovers every copy.
- ``broadcast``: one expert copied onto every other rank.

Baselines, measured in the same run:

- "unaligned": the policy's layout planned as is (no :func:`align_placement`): copies
  kept and MB moved.
- "no-relay rounds >=": a lower bound on the rounds of any schedule that sends every
  copy from an old holder (each rank sends one per round): ``max over experts of
  ceil(new copies / old holders)``; ``rounds x`` = that bound / our rounds.
- "reference": the slow sequential reference ``plan_migration_ref`` (EP64 only);
  ``ref / fast`` is its CPU time over ours.

Times are process CPU time, medians over repeats, one thread.

    make bench-migration      # or: python bench/bench_migration.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
for _root in ("controller", "workers", "proto"):
    if str(REPO / _root) not in sys.path:
        sys.path.insert(0, str(REPO / _root))

from expertmesh.planner import ModelSpec, Placement, Topology  # noqa: E402
from expertmesh.planner.migration import align_placement, plan_migration  # noqa: E402
from expertmesh.planner.refs import plan_migration_ref  # noqa: E402
from expertmesh.planner.static import static_placement  # noqa: E402


def cpu_ms(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median process CPU milliseconds of ``fn()`` over ``repeats``, and its last result."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.process_time()
        out = fn()
        times.append(time.process_time() - t0)
    return 1e3 * float(np.median(times)), out


def spare_layout(rng: np.random.Generator, topo: Topology, num_experts: int) -> Placement:
    base = static_placement(topo.num_ranks, topo.slots_per_rank, num_experts, topo.masters_per_rank)
    p2l = base.phy2log.copy()
    hot = rng.choice(num_experts, max(1, num_experts // 10), replace=False)
    p2l[:, topo.masters_per_rank :] = rng.choice(hot, size=(topo.num_ranks, topo.spare_per_rank))
    return Placement(phy2log=p2l, master=base.master)


def shuffled(rng: np.random.Generator, p: Placement, topo: Topology) -> Placement:
    """``p`` with nodes permuted inside each DC and ranks inside each node."""
    perm = np.arange(topo.num_ranks)
    start = 0
    for dc in topo.dcs:
        nodes = rng.permutation(dc.nodes)
        for a, c in enumerate(nodes):
            ranks = start + c * dc.ranks_per_node + rng.permutation(dc.ranks_per_node)
            perm[start + a * dc.ranks_per_node + np.arange(dc.ranks_per_node)] = ranks
        start += dc.num_ranks
    s = topo.slots_per_rank
    p2l = np.empty_like(p.phy2log)
    p2l[perm] = p.phy2log
    return Placement(phy2log=p2l, master=perm[p.master // s] * s + p.master % s)


def broadcast(topo: Topology) -> tuple[Placement, Placement]:
    r = topo.num_ranks
    rows = np.full((r, topo.slots_per_rank), -1, dtype=np.int32)
    rows[:, 0] = np.arange(r)
    old = Placement(phy2log=rows, master=np.arange(r) * topo.slots_per_rank)
    new = rows.copy()
    new[1:, 1] = 0
    return old, Placement(phy2log=new, master=old.master)


def no_relay_rounds(old: Placement, new: Placement, num_experts: int) -> int:
    """Lower bound on rounds when every copy comes from an old holder."""
    had = old.holds()
    need = new.holds() & ~had
    holders = had.sum(axis=0)
    return int(np.max(np.ceil(need.sum(axis=0) / np.maximum(holders, 1)), initial=0))


def run(name: str, topo: Topology, old: Placement, new: Placement, relabel: bool, reps: int,
        with_ref: bool) -> dict[str, Any]:  # fmt: skip
    num_experts = int(old.master.size)
    model = ModelSpec(num_experts=num_experts)
    t_align, al = cpu_ms(lambda: align_placement(old, new, topo, relabel), reps)
    t_plan, mig = cpu_ms(lambda: plan_migration(old, al, topo, model), reps)
    raw = plan_migration(old, new, topo, model)
    row = {
        "scenario": name,
        "R": topo.num_ranks,
        "E": num_experts,
        "copies": mig.copies,
        "kept": mig.kept,
        "kept unaligned": raw.kept,
        "MB moved": mig.nbytes / 1e6,
        "MB unaligned": raw.nbytes / 1e6,
        "rounds": mig.num_rounds,
        "no-relay rounds >=": no_relay_rounds(old, al, num_experts),
        "modeled s": mig.seconds,
        "align ms": t_align,
        "plan ms": t_plan,
        "ref / fast": "",
    }
    row["rounds x"] = row["no-relay rounds >="] / max(mig.num_rounds, 1)
    if with_ref:
        t_ref, ref = cpu_ms(lambda: plan_migration_ref(old, al, topo, model), max(1, reps // 5))
        row["ref / fast"] = f"{t_ref / t_plan:.0f}x (ref {ref.num_rounds} rounds)"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no 8,000-rank E=32000")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    reps_small, reps_big = (5, 1) if args.quick else (30, 3)
    ep64 = Topology.generate(1, 64, nodes_per_dc=8)
    wide = Topology.generate(1000, 8)
    d = wide.to_dict()  # the same with 500 faster DC pairs (the slower path of the scheduler)
    d["links"]["pairs"] = [
        {"a": f"dc{i:04d}", "b": f"dc{i + 1:04d}", "gbps": 40, "latency_ms": 5}
        for i in range(0, 1000, 2)
    ]
    paired = Topology.from_dict(d)
    rows = []
    old = spare_layout(rng, ep64, 256)
    rows.append(run("spare", ep64, old, spare_layout(rng, ep64, 256), False, reps_small, True))
    rows.append(run("shuffled", ep64, old, shuffled(rng, old, ep64), True, reps_small, True))
    rows.append(run("broadcast", ep64, *broadcast(ep64), False, reps_small, True))
    old = spare_layout(rng, wide, 256)
    new = spare_layout(rng, wide, 256)
    rows.append(run("spare", wide, old, new, False, reps_big, False))
    if not args.quick:
        rows.append(run("spare, 500 pairs", paired, old, new, False, reps_big, False))
        old = spare_layout(rng, wide, 32000)
        rows.append(run("spare", wide, old, spare_layout(rng, wide, 32000), False, reps_big, False))
        rows.append(run("shuffled", wide, old, shuffled(rng, old, wide), True, reps_big, False))
    rows.append(run("broadcast", wide, *broadcast(wide), False, reps_big, False))

    cols = ["scenario", "R", "E", "copies", "kept", "kept unaligned", "MB moved",
            "MB unaligned", "rounds", "no-relay rounds >=", "rounds x", "modeled s",
            "align ms", "plan ms", "ref / fast"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(
            f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")  # fmt: skip


if __name__ == "__main__":
    main()
