"""Balancing in training (issue 12's "Measure"): the fast loop on the demo model and shape.

The demo's shape (3 DCs x 3 ranks, 24 experts, 3 master + 2 spare slots per rank: a DC
holds 15 of 24; ``LMConfig(num_experts=24)``, 2 MoE layers, top-2, 16 x 64 tokens per rank
per microbatch; skewed routing emerges from training, no auxiliary loss) on the SPMD data
plane, one local Ray cluster for the run, a fresh runtime per row (same seed and data).

1. **Balance** at 1 Gbit/s, 20 ms: per microbatch and layer the measured max/mean of the
   assignments each rank computed (``1 / balancedness``; with 1 microbatch per step each
   layer of a step is one microbatch), for ``hybrid`` with the fast loop (``balance=True``,
   ``reserve_slots: 1`` as the demo), ``hybrid`` slow loop only (``balance=False``) and
   ``static``; beside them static EP on the fast loop's own tokens (``imbalance_static``)
   and the floor the fast loop can reach: it balances inside each DC only, so a layer's
   max/mean is at least (max over DCs of the DC's mean) / (global mean), from the same
   tokens. Medians over the steps after the first plan switched in.
2. **Time**: end-to-end median step (``seconds``) with balancing on vs off, and the exposed
   balancing overhead ``balance_seconds / seconds`` (counts all-gather + quota solve +
   replica fetch, max over ranks; summed over layers; in the forward's critical path).
3. **Constrained links**: ``hybrid`` with the fast loop vs ``static`` at 20 Mbit/s on 2
   DCs (2 x 3 ranks, 4 master + 2 spare slots: a DC holds 18 of 24) and 3 DCs, with 1 and
   4 microbatches per optimizer step, each row with the SPMD step model's prediction
   (``planner.stepmodel.spmd_step_cost``, calibrated per DC count on static over free
   links at two batch sizes: ``spmdbench.calibrate``).

Medians over each row's steps after the first; ratios against rows of the same run.

    make bench-balance      # also runs bench_balance.py (the solver)
    python bench/bench_balance_train.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
for _root in ("controller", "workers", "proto", "bench"):
    if str(REPO / _root) not in sys.path:
        sys.path.insert(0, str(REPO / _root))

from spmdbench import (  # noqa: E402
    SharedCluster,
    SpmdRun,
    calibrate,
    predict,
    run_spmd,
    tokens_per_rank,
)

from expertmesh.controller.core import Trigger  # noqa: E402 (after the source roots)
from expertmesh.planner import Topology  # noqa: E402
from expertmesh.runtime.settings import RuntimeSettings  # noqa: E402
from expertmesh.workers.model import LMConfig  # noqa: E402

EXPERTS, SPARE, RANKS_PER_DC, LATENCY_MS = 24, 2, 3, 20.0
MODES = {  # label -> (policy, fast loop)
    "hybrid + fast loop": ("hybrid", True),
    "hybrid, slow loop only": ("hybrid", False),
    "static": ("static", False),
}


def topology(dcs: int, gbps: float, latency_ms: float = LATENCY_MS) -> Topology:
    masters = -(-EXPERTS // (dcs * RANKS_PER_DC))  # 3 on 3 DCs (the demo), 4 on 2
    return Topology.generate(dcs, RANKS_PER_DC, masters=masters, spare=SPARE).with_inter_dc(
        gbps, latency_ms
    )


def settings(topo: Topology, lm: LMConfig, mode: str, args: argparse.Namespace) -> RuntimeSettings:
    policy, fast = MODES[mode]
    return RuntimeSettings(
        topology=topo.to_dict(),
        lm=lm,
        policy=policy,
        policy_settings={"reserve_slots": 1} if policy == "hybrid" and fast else {},
        trigger=Trigger(mode="every_n", every=args.every),
        balance=fast,
        corpus_bytes=args.corpus_bytes,
    )


def floor(run: SpmdRun, steps: list[Any]) -> list[float]:
    """Per (step, layer): max over DCs of the DC's mean over the global mean, from the
    tokens each rank computed (what balancing inside DCs alone can reach)."""
    rank_dc = np.asarray(Topology.from_dict(run.settings.topology).rank_dc)
    out = []
    for s in steps:
        for per_rank in s.tokens_per_layer_rank:
            t = np.asarray(per_rank, dtype=np.float64)
            means = [t[rank_dc == d].mean() for d in range(int(rank_dc.max()) + 1)]
            out.append(float(max(means) / t.mean()))
    return out


def balanced_steps(run: SpmdRun) -> list[Any]:
    """The steps after the first plan switched in (all but the first for static)."""
    later = [s for s in run.steps[1:] if s.plan_version >= 1]
    return later if len(later) >= 2 else run.steps[1:]


def balance_row(label: str, run: SpmdRun, base: SpmdRun | None) -> dict[str, Any]:
    steps = balanced_steps(run)
    per_mb = [1.0 / b for s in steps for b in (s.balancedness or [])]
    med = statistics.median(s.seconds for s in steps)  # type: ignore[type-var]
    out = {
        "mode": label,
        "steps_used": [s.step for s in steps],
        "median_max_over_mean": statistics.median(per_mb),
        "max_max_over_mean": max(per_mb),
        "median_worst_layer": statistics.median(s.imbalance for s in steps),
        "median_static_same_tokens": statistics.median(s.imbalance_static or 0.0 for s in steps),
        "median_floor": statistics.median(floor(run, steps)),
        "median_seconds": med,
        "median_balance_fraction": statistics.median(
            s.balance_seconds / s.seconds  # type: ignore[operator]
            for s in steps
        ),
        "median_replicas": statistics.median(s.replicas for s in steps),
        "median_fanout_mb": statistics.median(s.fanout_bytes for s in steps) / 1e6,
        "per_microbatch": per_mb,
        "seconds": [s.seconds for s in run.steps],
        "imbalance": [s.imbalance for s in run.steps],
        "plan_versions": [s.plan_version for s in run.steps],
    }
    if base is not None:
        out["speedup_vs_static"] = (
            statistics.median(
                s.seconds  # type: ignore[misc]
                for s in balanced_steps(base)
            )
            / med
        )
    return out


def bench(args: argparse.Namespace) -> dict[str, Any]:
    lm = LMConfig(num_experts=EXPERTS, batch=args.batch)
    out: dict[str, Any] = {"balance": [], "links": [], "calibrations": []}
    with SharedCluster(3) as cluster:
        print(f"cluster up in {cluster.start_seconds:.1f}s", flush=True)
        if not args.quick:
            run_spmd(settings(topology(3, 1e4, 0.0), lm, "static", args), 2)  # warm-up, unused
        topo = topology(3, args.gbps)
        runs = {m: run_spmd(settings(topo, lm, m, args), args.steps) for m in MODES}
        for mode, run in runs.items():
            r = balance_row(mode, run, runs["static"])
            out["balance"].append(r)
            print(f"  {args.gbps:g} Gbit/s {_bline(r)}", flush=True)
        for dcs in args.dcs:
            free = topology(dcs, 1e4, 0.0)
            small = lm.model_copy(update={"batch": max(args.batch // 4, 1)})
            cal = calibrate(
                run_spmd(settings(free, lm, "static", args), args.calib_steps),
                run_spmd(settings(free, small, "static", args), args.calib_steps),
            )
            out["calibrations"].append({"dcs": dcs, **cal.__dict__, "load": os.getloadavg()[0]})
            print(
                f"{dcs} DCs calibration: a = {cal.seconds_per_token * 1e6:.1f} us/token, c = "
                f"{cal.collective_seconds * 1e3:.2f} ms/collective (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
            slow = topology(dcs, args.slow_gbps)
            for k in args.microbatches:
                lk = lm.model_copy(update={"microbatches": k})
                group = {}
                for mode in ("static", "hybrid + fast loop"):
                    group[mode] = run_spmd(settings(slow, lk, mode, args), args.link_steps)
                for mode, run in group.items():
                    pred = predict(run, cal)
                    med = run.median("seconds")
                    p = statistics.median(pred[1:])
                    r = {
                        "dcs": dcs,
                        "gbps": args.slow_gbps,
                        "microbatches": k,
                        "mode": mode,
                        "median_seconds": med,
                        "speedup_vs_static": group["static"].median("seconds") / med,
                        "predicted_seconds": p,
                        "predicted_over_measured": p / med,
                        "tokens_per_second_per_worker": tokens_per_rank(run.settings) / med,
                        "median_imbalance": run.median("imbalance"),
                        "seconds": [s.seconds for s in run.steps],
                        "predicted": pred,
                    }
                    out["links"].append(r)
                    print(f"  {_lline(r)}", flush=True)
    return out


def _bline(r: dict[str, Any]) -> str:
    return (
        f"{r['mode']:22s} max/mean {r['median_max_over_mean']:.3f} (floor "
        f"{r['median_floor']:.3f}, static same tokens {r['median_static_same_tokens']:.2f}) "
        f"step {r['median_seconds']:.3f}s x{r.get('speedup_vs_static', 1.0):.2f} vs static, "
        f"balancing {r['median_balance_fraction']:.1%} of the step"
    )


def _lline(r: dict[str, Any]) -> str:
    return (
        f"{r['dcs']} DCs {r['gbps'] * 1000:g} Mbit/s k={r['microbatches']} {r['mode']:18s} "
        f"median {r['median_seconds']:.3f}s x{r['speedup_vs_static']:.2f} vs static, "
        f"predicted {r['predicted_seconds']:.3f}s ({r['predicted_over_measured']:.2f})"
    )


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| mode | max/mean per microbatch and layer, median | max | worst layer per step, "
        "median | static EP on the same tokens | floor (max DC mean / mean) | median s/step "
        "| vs static | balancing % of step | replicas/step | fan-out MB/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["balance"]:
        lines.append(
            f"| {r['mode']} | {r['median_max_over_mean']:.3f} | {r['max_max_over_mean']:.3f} "
            f"| {r['median_worst_layer']:.3f} | {r['median_static_same_tokens']:.2f} "
            f"| {r['median_floor']:.3f} | {r['median_seconds']:.3f} "
            f"| {r.get('speedup_vs_static', 1.0):.2f}x | {100 * r['median_balance_fraction']:.1f} "
            f"| {r['median_replicas']:g} | {r['median_fanout_mb']:.2f} |"
        )
    lines += [
        "",
        "| DCs | inter-DC | microbatches | mode | median s/step | vs static | predicted s "
        "| pred / meas | tokens/s/worker | max/mean (worst) |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["links"]:
        ratio = f"{r['predicted_over_measured']:.2f}"
        bad = abs(r["predicted_over_measured"] - 1) > 0.15
        lines.append(
            f"| {r['dcs']} | {r['gbps'] * 1000:g} Mbit/s | {r['microbatches']} | {r['mode']} "
            f"| {r['median_seconds']:.3f} | {r['speedup_vs_static']:.2f}x "
            f"| {r['predicted_seconds']:.3f} | {f'**{ratio}**' if bad else ratio} "
            f"| {r['tokens_per_second_per_worker']:.0f} | {r['median_imbalance']:.2f} |"
        )
    lines += ["", "Calibration (static, free links, same run):", ""]
    lines += [
        f"- {c['dcs']} DCs: a = {c['seconds_per_token'] * 1e6:.1f} us per token, c = "
        f"{c['collective_seconds'] * 1e3:.2f} ms per collective (median step "
        f"{c['full_median']:.3f} s full batch, {c['small_median']:.3f} s quarter; load "
        f"{c['load']:.1f})"
        for c in result["calibrations"]
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=9, help="steps per balance row")
    p.add_argument("--every", type=int, default=3, help="steps between plans")
    p.add_argument("--gbps", type=float, default=1.0, help="inter-DC Gbit/s of the balance rows")
    p.add_argument("--slow-gbps", type=float, default=0.02, help="inter-DC Gbit/s, part 3")
    p.add_argument("--dcs", default="2,3", help="DC counts of part 3")
    p.add_argument("--microbatches", default="1,4", help="microbatches per step, part 3")
    p.add_argument("--link-steps", type=int, default=5, help="steps per part-3 row")
    p.add_argument("--calib-steps", type=int, default=4, help="steps per calibration run")
    p.add_argument("--batch", type=int, default=LMConfig().batch, help="sequences per rank")
    p.add_argument("--corpus-bytes", type=int, default=300_000)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny batch, few steps")
    p.add_argument("--json", type=Path, help="write every measurement here")
    args = p.parse_args(argv)
    args.dcs = [int(x) for x in args.dcs.split(",")]
    args.microbatches = [int(x) for x in args.microbatches.split(",")]
    if args.quick:
        args.steps, args.every, args.link_steps, args.calib_steps = 5, 2, 3, 3
        args.batch, args.dcs, args.microbatches = 4, [2], [2]
    if min(args.steps, args.link_steps, args.calib_steps) < 3:
        p.error("--steps, --link-steps and --calib-steps must be >= 3")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    logging.basicConfig(level=logging.WARNING)
    t0, load0 = time.perf_counter(), os.getloadavg()
    result = bench(args)
    result["seconds"] = time.perf_counter() - t0
    result["load_avg"] = [list(load0), list(os.getloadavg())]
    result["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result["markdown"] = markdown(result)
    print()
    print(result["markdown"])
    print(
        f"total {result['seconds']:.0f}s; load average {load0[0]:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end (2 cores)"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
