"""Balancing on vs off, end to end, where it can show: 2 ranks, each pinned to its own core.

Issue 12's "end-to-end step time: balancing on vs off" measured in the demo's shape (9
ranks on 2 shared cores, experts of hidden 32 and FFN 64) cannot show a win: every rank's
work runs on the same two cores, so evening out tokens does not shorten the step, and the
experts are too cheap per token for balance to matter (docs/benchmarks.md, "Balancing in
training"). Here:

- **2 ranks, one DC**, each worker process pinned to its own core
  (``RuntimeSettings.worker_cpus = [[0], [1]]``: every thread, ``os.sched_setaffinity``);
  the fast loop balances between them. Ray's own processes and the driver are not pinned
  (they idle while the workers train).
- **Expert compute dominates the step**: hidden 256, expert FFN 1024 (an expert is
  3 x 256 x 1024 = 786k parameters, 3.1 MB in float32; the dense part, 0.2M parameters, is
  smaller than one expert), 8 experts, top-2, 16 x 64 tokens per rank per microbatch.
  The share is measured: an expert's forward + backward seconds per assignment are timed
  in this process on one pinned core before the cluster starts (``a``), and the busiest
  rank's expert seconds of a step (sum over layers of ``a x`` its assignments) are put
  over the measured step.
- **Skewed routing**: learned, no auxiliary loss (as the demo); static's imbalance is
  measured, not built in.

Rows (one runtime each on one local Ray cluster, same seed and data, a plan every
``--every`` steps; medians over the steps after the first plan switched in):

- ``static``: static EP, no balancing (``balance=False``);
- ``static + fast loop``: static's masters, the fast loop on (quota on every microbatch's
  exact counts between the 2 ranks, replicas in the 2 spare slots per rank);
- ``hybrid, slow loop only``: hybrid's placement and route (copies in spare slots, tokens
  split by the plan's shares of an earlier window), ``balance=False``;
- ``hybrid + fast loop``: hybrid with ``reserve_slots: 1`` and the fast loop on;
- ``quota, slow loop only``: quota's plan on the last window's exact per-rank load (the
  slow loop at its best inside one domain), ``balance=False``;
- ``force-balanced ideal``: static EP, no balancing, with the router forced to balance
  (``LMConfig.router="balanced"``, as Megatron's force load balancing and UltraEP's
  ideal): every expert gets the same count on every rank, so both ranks do exactly the
  mean work, with the same tokens, collectives and dense work and no balancing cost.
  UltraEP's 94.3% is its balanced run's throughput over such a run's, the same ratio as
  "ideal / row" here.

Each row: median s/step, vs static and vs the ideal (same run), max/mean, exposed
balancing seconds (``balance_seconds``: counts all-gather + quota solve + replica fetch
not hidden by compute, max over ranks) over the step, the busiest rank's expert seconds
(``a`` x its assignments) and their share of the step, and where the time goes: each
rank's own reports (kept by the worker, ``controller_view``): forward + backward, of it
the busiest rank's expert forward, the sync (gradients, Adam, replica refresh), outside
the step (the step's undo snapshot, a plan switch, the report).

    make bench-balance-cores
    python bench/bench_balance_cores.py [--steps 20] [--every 3] [--no-pin] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

REPO = Path(__file__).resolve().parents[1]
for _root in ("controller", "workers", "proto", "bench"):
    if str(REPO / _root) not in sys.path:
        sys.path.insert(0, str(REPO / _root))

from spmdbench import (  # noqa: E402
    SharedCluster,
    SpmdRun,
    run_bench,
    temporary_trace_dir,
)

from expertmesh.controller.core import Trigger  # noqa: E402 (after the source roots)
from expertmesh.planner import Topology  # noqa: E402
from expertmesh.runtime.settings import RuntimeSettings, StepResult  # noqa: E402
from expertmesh.runtime.spmd import SpmdRuntime  # noqa: E402
from expertmesh.workers.model import LMConfig, expert_forward, init_expert  # noqa: E402

RANKS, EXPERTS, MASTERS, SPARE = 2, 8, 4, 2
MODES = {  # label -> (policy, fast loop, policy settings, router)
    "static": ("static", False, {}, "learned"),
    "static + fast loop": ("static", True, {}, "learned"),
    "hybrid, slow loop only": ("hybrid", False, {}, "learned"),
    "hybrid + fast loop": ("hybrid", True, {"reserve_slots": 1}, "learned"),
    "quota, slow loop only": ("quota", False, {}, "learned"),
    "force-balanced ideal": ("static", False, {}, "balanced"),
}
IDEAL = "force-balanced ideal"


def lm_config(args: argparse.Namespace) -> LMConfig:
    return LMConfig(
        num_experts=EXPERTS, hidden=args.hidden, ffn_hidden=args.ffn, batch=args.batch,
        microbatches=args.microbatches,
    )  # fmt: skip


def settings(lm: LMConfig, mode: str, args: argparse.Namespace, cpus: Any) -> RuntimeSettings:
    policy, fast, more, router = MODES[mode]
    topo = Topology.generate(1, RANKS, masters=MASTERS, spare=SPARE)
    return RuntimeSettings(
        topology=topo.to_dict(), lm=lm.model_copy(update={"router": router}), policy=policy,
        policy_settings=more,
        trigger=Trigger(mode="every_n", every=args.every), balance=fast,
        corpus_bytes=args.corpus_bytes, checkpoint_every=0, worker_cpus=cpus,
    )  # fmt: skip


def expert_seconds_per_assignment(lm: LMConfig, cpu: int, repeats: int) -> dict[str, Any]:
    """Forward + backward seconds of one expert per assignment (``a``, the slope over row
    counts around a rank's share) and of the forward alone, timed here on ``cpu`` with one
    torch thread, as the workers run."""
    import torch

    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    w = [t.requires_grad_(True) for t in init_expert(lm, 0, 0)]
    rows = [256, 512, 1024, 1536, 2048]
    fb, fw = [], []
    try:
        for m in rows:
            x = torch.randn(m, lm.hidden, requires_grad=True)
            t_fb, t_fw = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                y = expert_forward(x, tuple(w))  # type: ignore[arg-type]
                t1 = time.perf_counter()
                y.sum().backward()
                t2 = time.perf_counter()
                t_fw.append(t1 - t0)
                t_fb.append(t2 - t0)
            fb.append(statistics.median(t_fb))
            fw.append(statistics.median(t_fw))
    finally:
        os.sched_setaffinity(0, saved)
    slope_fb, icpt = np.polyfit(rows, fb, 1)
    slope_fw, _ = np.polyfit(rows, fw, 1)
    return {
        "fb": float(slope_fb), "fw": float(slope_fw), "intercept": float(icpt),
        "rows": rows, "fb_seconds": fb, "fw_seconds": fw,
    }  # fmt: skip


def balanced_steps(run: SpmdRun) -> list[StepResult]:
    """The steps after the first plan switched in (all but the first for static)."""
    later = [s for s in run.steps[1:] if s.plan_version >= 1]
    return later if len(later) >= 3 else run.steps[1:]


def busiest(s: StepResult) -> float:
    """Assignments of the busiest rank of each layer, summed over layers."""
    return float(np.asarray(s.tokens_per_layer_rank, dtype=np.float64).max(axis=1).sum())


def row(
    label: str, run: SpmdRun, ranks: dict[int, list[dict[str, Any]]], a: float
) -> dict[str, Any]:
    """Medians over :func:`balanced_steps`; ``ranks``: every rank's own reports (seconds
    of forward + backward and of the sync, forward expert seconds) by step."""
    steps = balanced_steps(run)
    mine = {  # step -> that step's report of every rank
        s.step: [next(x for x in reps if x["step"] == s.step) for reps in ranks.values()]
        for s in steps
    }

    def m(f: Any) -> float:
        return float(statistics.median(f(s) for s in steps))

    def worst(s: StepResult, f: Any) -> float:
        return max(float(f(x)) for x in mine[s.step])

    return {
        "mode": label,
        "steps_used": [s.step for s in steps],
        "median_seconds": m(lambda s: s.seconds),
        "median_forward_backward": m(
            lambda s: worst(s, lambda x: x["seconds"]["forward_backward"])
        ),
        "median_sync": m(lambda s: worst(s, lambda x: x["seconds"]["sync"])),
        "median_outside_step": m(lambda s: s.seconds - s.step_seconds),
        "median_expert_forward_busiest": m(lambda s: worst(s, lambda x: sum(x["expert_seconds"]))),
        "median_max_over_mean": m(lambda s: max(1.0 / b for b in s.balancedness or [1.0])),
        "median_imbalance_static": m(lambda s: s.imbalance_static or 0.0),
        "median_expert_critical": m(lambda s: a * busiest(s)),
        "median_expert_share": m(lambda s: a * busiest(s) / s.seconds),
        "median_balance_seconds": m(lambda s: s.balance_seconds),
        "median_balance_fraction": m(lambda s: s.balance_seconds / s.seconds),
        "median_replicas": m(lambda s: s.replicas),
        "median_fanout_mb": m(lambda s: s.fanout_bytes / 1e6),
        "seconds": [s.seconds for s in run.steps],
        "plan_versions": [s.plan_version for s in run.steps],
        "max_over_mean": [max(1.0 / b for b in s.balancedness or [1.0]) for s in run.steps],
        "tokens_per_layer_rank": [s.tokens_per_layer_rank for s in run.steps],
        "loss": [s.loss for s in run.steps],
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    lm = lm_config(args)
    cpus_here = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus_here) < RANKS:
        raise SystemExit(f"--pin needs {RANKS} CPUs, this process may use {cpus_here}")
    cpus = [[c] for c in cpus_here[:RANKS]] if args.pin else None
    cost = expert_seconds_per_assignment(lm, cpus_here[0], args.repeats)
    a = cost["fb"]
    print(
        f"expert (hidden {lm.hidden}, FFN {lm.ffn_hidden}) on one core: forward + backward "
        f"{a * 1e6:.2f} us per assignment (forward {cost['fw'] * 1e6:.2f} us)",
        flush=True,
    )
    out: dict[str, Any] = {"expert_cost": cost, "rows": [], "worker_cpus": cpus}
    with SharedCluster(1) as cluster:
        print(f"cluster up in {cluster.start_seconds:.1f}s", flush=True)
        for mode in MODES:
            run, ranks = _pinned_run(settings(lm, mode, args, cpus), args.steps, cpus)
            r = row(mode, run, ranks, a)
            out["rows"].append(r)
            print(f"  {_line(r)}", flush=True)
    rows = {r["mode"]: r for r in out["rows"]}
    for r in out["rows"]:
        r["speedup_vs_static"] = rows["static"]["median_seconds"] / r["median_seconds"]
        r["ideal_over_row"] = rows[IDEAL]["median_seconds"] / r["median_seconds"]
    return out


def _pinned_run(
    st: RuntimeSettings, steps: int, cpus: list[list[int]] | None
) -> tuple[SpmdRun, dict[int, list[dict[str, Any]]]]:
    """One runtime's training (on the shared cluster; the workers' own word on where they
    run checked first) and every rank's reports of its steps, as the worker kept them."""
    where = temporary_trace_dir()
    st = st.model_copy(update={"trace_dir": str(where)})
    t0 = time.perf_counter()
    with SpmdRuntime(st) as rt:
        got = [p["cpus"] for p in rt.nodes]
        if cpus is not None and got != cpus:
            raise SystemExit(f"workers run on CPUs {got}, asked for {cpus}")
        t1, c1 = time.perf_counter(), time.process_time()
        rows = rt.train(steps)
        t2, c2 = time.perf_counter(), time.process_time()
        views = ray.get([w.controller_view.remote() for w in rt.workers])
    ranks = {v["rank"]: list(v["reports"]) for v in views}
    return SpmdRun(st, rows, where, t1 - t0, t2 - t1, c2 - c1), ranks


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['mode']:24s} {r['median_seconds']:.3f} s/step, max/mean "
        f"{r['median_max_over_mean']:.3f} (static on the same tokens "
        f"{r['median_imbalance_static']:.2f}), expert share {r['median_expert_share']:.0%}, "
        f"balancing {r['median_balance_fraction']:.1%}, replicas {r['median_replicas']:g}"
    )


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| mode | median s/step | vs static | ideal / row | max/mean, median | static EP on "
        "the same tokens | busiest rank's expert s, fwd + bwd (share of step) | balancing s "
        "(% of step) | replicas / step | fan-out MB / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['mode']} | {r['median_seconds']:.3f} | {r['speedup_vs_static']:.2f}x "
            f"| {100 * r['ideal_over_row']:.1f}% | {r['median_max_over_mean']:.3f} "
            f"| {r['median_imbalance_static']:.3f} "
            f"| {r['median_expert_critical']:.3f} ({100 * r['median_expert_share']:.0f}%) "
            f"| {r['median_balance_seconds']:.3f} ({100 * r['median_balance_fraction']:.1f}%) "
            f"| {r['median_replicas']:g} | {r['median_fanout_mb']:.1f} |"
        )
    lines += [
        "",
        "| mode | median s/step | forward + backward (max over ranks) | of it: busiest rank's "
        "expert forward, measured | sync: gradients, Adam, refresh (max over ranks) | outside "
        "the step: snapshot, switch, report |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['mode']} | {r['median_seconds']:.3f} | {r['median_forward_backward']:.3f} "
            f"| {r['median_expert_forward_busiest']:.3f} | {r['median_sync']:.3f} "
            f"| {r['median_outside_step']:.3f} |"
        )
    c = result["expert_cost"]
    return "\n".join(lines) + (
        f"\n\nExpert forward + backward: {c['fb'] * 1e6:.2f} us per assignment (forward "
        f"{c['fw'] * 1e6:.2f} us), one core, one torch thread.\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="steps per row")
    p.add_argument("--every", type=int, default=3, help="steps between plans")
    p.add_argument("--hidden", type=int, default=256, help="model width d")
    p.add_argument("--ffn", type=int, default=1024, help="expert FFN width f")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per microbatch")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches per step")
    p.add_argument("--corpus-bytes", type=int, default=300_000)
    p.add_argument("--repeats", type=int, default=7, help="timings per size of the expert cost")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="leave the workers unpinned")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, few steps")
    p.add_argument("--json", type=Path, help="write every measurement here")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.hidden, args.ffn, args.batch, args.repeats = 6, 32, 64, 4, 2
    if args.steps < 5:
        p.error("--steps must be >= 5")
    return run_bench(args, bench, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
