"""Balancing in training (issue 12's "Measure"): the fast loop on the demo model and shape.

The demo's shape (3 DCs x 3 ranks, 24 experts, 3 master + 2 spare slots per rank: a DC
holds 15 of 24; ``LMConfig(num_experts=24)``, 2 MoE layers, top-2, 16 x 64 tokens per rank
per microbatch; skewed routing emerges from training, no auxiliary loss) on the SPMD data
plane, one local Ray cluster for the run, a fresh runtime per row (same seed and data).

1. **Balance** at 1 Gbit/s, 20 ms: per microbatch and layer the measured max/mean of the
   assignments each rank computed (``1 / balancedness``; with 1 microbatch per step each
   layer of a step is one microbatch), for ``hybrid`` with the fast loop (``balance=True``,
   the demo's slow loop: ``cli.demo.FAST_LOOP_HYBRID``, ``reserve_slots: 1``, ``even_dcs``,
   ``period: 5``, ``window: 1``, and ``planner_level`` on every row; the bench re-plans
   every 3 steps (``--every``), the demo every 5; crossing tokens' DCs chosen every microbatch from the
   world's counts, ``spread=True``: the counts all-gather stands in for the dispatch's
   sizes exchange, ``spread_fused``, or the sizes exchanged after the split; and, as
   before, by the plan's route), ``hybrid`` slow
   loop only (``balance=False``) and ``static``; beside them static EP on the fast loop's
   own tokens (``imbalance_static``) and the floor the fast loop can reach: it balances
   inside each DC only, so a layer's
   max/mean is at least (max over DCs of the DC's mean) / (global mean), from the same
   tokens. Medians over the steps after the first plan switched in.
2. **Time**: end-to-end median step (``seconds``) with balancing on vs off, and the exposed
   balancing overhead ``balance_seconds / seconds`` (the counts all-gather where it is an
   exchange of its own (not where it stands in for the dispatch's sizes exchange) + the
   split by DC + quota solve + replica fetch, max over ranks; summed over layers; in the
   forward's critical path), and the cross-DC token bytes per step.
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
import os
import statistics
import sys
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
    run_bench,
    run_spmd,
    tokens_per_rank,
)

from expertmesh.cli.demo import FAST_LOOP_HYBRID  # noqa: E402 (after the source roots)
from expertmesh.controller.core import Trigger  # noqa: E402
from expertmesh.formats import read_plan, read_trace  # noqa: E402
from expertmesh.planner import Placement, Topology  # noqa: E402
from expertmesh.planner.dcsplit import split_dcs  # noqa: E402
from expertmesh.planner.fastquota import DEFAULTS, EXACT, BalanceSettings  # noqa: E402
from expertmesh.runtime.settings import RuntimeSettings  # noqa: E402
from expertmesh.workers.balance import DomainBase, solve  # noqa: E402
from expertmesh.workers.model import LMConfig  # noqa: E402
from expertmesh.workers.moe import relay_counts  # noqa: E402

EXPERTS, SPARE, RANKS_PER_DC, LATENCY_MS = 24, 2, 3, 20.0
MODES = {  # label -> (policy, fast loop, crossing tokens' DCs per microbatch, fused)
    "hybrid + fast loop": ("hybrid", True, True, True),
    "hybrid + fast loop, sizes exchanged": ("hybrid", True, True, False),
    "hybrid + fast loop, route's DCs": ("hybrid", True, False, True),
    "hybrid, slow loop only": ("hybrid", False, False, True),
    "static": ("static", False, False, True),
}


def topology(dcs: int, gbps: float, latency_ms: float = LATENCY_MS) -> Topology:
    masters = -(-EXPERTS // (dcs * RANKS_PER_DC))  # 3 on 3 DCs (the demo), 4 on 2
    return Topology.generate(dcs, RANKS_PER_DC, masters=masters, spare=SPARE).with_inter_dc(
        gbps, latency_ms
    )


def settings(
    topo: Topology,
    lm: LMConfig,
    mode: str,
    args: argparse.Namespace,
    migration: str = "background",
    every: int | None = None,
) -> RuntimeSettings:
    policy, fast, spread, fused = MODES[mode]
    return RuntimeSettings(
        topology=topo.to_dict(),
        lm=lm,
        policy=policy,
        policy_settings=dict(FAST_LOOP_HYBRID) if policy == "hybrid" and fast else {},
        trigger=Trigger(mode="every_n", every=every or args.every),
        planner_level=True,  # as the demo: the planner's level on every step's exact counts
        balance=fast,
        spread=spread,
        spread_fused=fused,
        corpus_bytes=args.corpus_bytes,
        migration=migration,  # type: ignore[arg-type]
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


def within_and_floor(run: SpmdRun, steps: list[Any]) -> dict[str, Any]:
    """Per microbatch and layer (the controller's grids): the worst DC's own max/mean (what
    the fast loop reaches inside DCs) and the floor (busiest DC's mean / global mean); and
    what lowering the floor to 1 by routing tokens across DCs would cost and save per step:
    the busiest DC hands its excess assignments (its mean over the global mean, times its
    ranks) to the others, each an activation out and its result back, forward and backward
    (4 x hidden float32; an upper bound: assignments, not distinct tokens), over one DC
    pair's link; it saves the busiest ranks that excess over their ranks at the measured
    expert seconds per assignment."""
    topo = Topology.from_dict(run.settings.topology)
    rank_dc = np.asarray(topo.rank_dc)
    within = [x for s in steps for row in (s.imbalance_within_dc or []) for x in row]
    floors = [x for s in steps for row in (s.imbalance_floor or []) for x in row]
    excess, saved = [], []
    for s in steps:
        per = np.asarray(s.tokens_per_layer_rank, dtype=np.float64)  # [L, R] over the step
        dcs = [rank_dc == d for d in range(topo.num_dcs)]
        busiest = np.max([per[:, m].mean(axis=1) for m in dcs], axis=0)  # [L]
        over = (busiest - per.mean(axis=1)) * RANKS_PER_DC  # [L] assignments to hand off
        excess.append(float(over.sum()))
        saved.append(float((over / RANKS_PER_DC).sum()) * (s.expert_seconds_per_assignment or 0))
    per_assignment = 4 * run.settings.lm.hidden * 4  # bytes: out, back, forward, backward
    wan = statistics.median(excess) * per_assignment
    return {
        "median_within_dc": statistics.median(within) if within else float("nan"),
        "median_floor_grid": statistics.median(floors) if floors else float("nan"),
        "floor_excess_assignments": statistics.median(excess),
        "floor_wan_bytes": wan,
        "floor_wan_seconds": {
            f"{g:g}": wan * 8 / (g * 1e9) for g in (1.0, 0.1, 0.02)
        },  # at 1 Gbit/s, 100 and 20 Mbit/s
        "floor_saved_seconds": statistics.median(saved),
    }


VARIANTS = {  # the fast loop's solve inside each DC, replayed on a run's own counts
    "as run (economy defaults, chains)": DEFAULTS,
    "quota rule alone (no chains)": BalanceSettings(chains=False),
    "exact rule (no economy, no chains)": EXACT,
    "exact rule + chains": EXACT.model_copy(update={"chains": True}),
}


def replay_within(run: SpmdRun, steps: list[Any]) -> dict[str, Any]:
    """The fast loop's decisions replayed from the run's trace (``trace.npz``: each step's
    counts, one microbatch per step; ``plans.npz``: the plan it ran on): the split by DC
    (:func:`split_dcs`) and, per DC, the solve under each of :data:`VARIANTS`; medians of
    max/mean, within DC and floor over ``steps``' layers. ``matches``: whether the replay
    of the settings the run used gives every rank exactly the tokens it computed."""
    trace = read_trace(run.trace_dir / "trace.npz")
    plans = read_plan(run.trace_dir / "plans.npz")
    topo = Topology.from_dict(run.settings.topology)
    rank_dc = np.asarray(topo.rank_dc)
    dcs = [np.flatnonzero(rank_dc == d) for d in range(topo.num_dcs)]
    index = {int(n): i for i, n in enumerate(trace.meta["steps"])} if "steps" in trace.meta else {}
    out: dict[str, list[tuple[float, float, float]]] = {k: [] for k in VARIANTS}
    matches = True
    for s in steps:
        i = index.get(s.step, s.step)
        for layer, measured in enumerate(s.tokens_per_layer_rank):
            counts = trace.load[i, layer].astype(np.int64)
            assert plans.phy2log is not None and plans.master is not None  # plans.npz has both
            placement = Placement(plans.phy2log[i, layer], plans.master[i, layer])
            holds = np.stack([placement.holds()[m].any(axis=0) for m in dcs])
            split = split_dcs(counts, holds, rank_dc)
            for name, st in VARIANTS.items():
                per = np.zeros(rank_dc.size)
                for d, ranks in enumerate(dcs):
                    sol = solve(relay_counts(split.tokens, d, rank_dc),
                                DomainBase.of(placement, ranks), settings=st)  # fmt: skip
                    per[ranks] = np.bincount(sol.route[:, 2], weights=sol.route[:, 3],
                                             minlength=ranks.size)  # fmt: skip
                within = max(per[m].max() / per[m].mean() for m in dcs)
                out[name].append((per.max() / per.mean(), within, split.floor))
                if st is DEFAULTS and not np.array_equal(per, measured):
                    matches = False
    med = statistics.median
    return {
        "matches": matches,
        "variants": {
            k: {
                "max_over_mean": med(x[0] for x in v),
                "within_dc": med(x[1] for x in v),
                "floor": med(x[2] for x in v),
            }
            for k, v in out.items()
            if v
        },
    }


def migration_row(label: str, run: SpmdRun) -> dict[str, Any]:
    """Per plan switch: seconds it held the critical path (max over ranks; boundary: the
    migration rounds and switch; background: starting the transfer, waiting for what had
    not landed, switching) and cross-DC bytes at the boundary vs in the background; and
    the step-time view: the steps a switch touched (background: the one that started the
    transfer too) against the median of the others, per switch."""
    sw = [s for s in run.steps[1:] if s.switch]
    background = run.settings.migration == "background"
    touched = {s.step for s in sw} | ({s.step - 1 for s in sw} if background else set())
    others = [s.seconds for s in run.steps[1:] if s.step not in touched]
    base = statistics.median(others) if others else float("nan")
    extra = sum(s.seconds - base for s in run.steps[1:] if s.step in touched)
    med = statistics.median
    return {
        "mode": label,
        "migration": run.settings.migration,
        "switches": len(sw),
        "critical_seconds": med(s.switch["seconds"] for s in sw) if sw else float("nan"),
        "wait_seconds": med(s.switch["wait_seconds"] for s in sw) if sw else float("nan"),
        "boundary_mb": med(s.switch["boundary_bytes"] for s in sw) / 1e6 if sw else 0.0,
        "background_mb": med(s.switch["background_bytes"] for s in sw) / 1e6 if sw else 0.0,
        "step_extra_seconds": extra / len(sw) if sw else float("nan"),
        "median_other_seconds": base,
        "losses": [s.loss for s in run.steps],
        "switch_steps": [s.step for s in sw],
        "switches_all": [s.switch for s in sw],
        "boundary_mb_total": sum(s.switch["boundary_bytes"] for s in sw) / 1e6,
        "background_mb_total": sum(s.switch["background_bytes"] for s in sw) / 1e6,
        "seconds": [s.seconds for s in run.steps],
    }


def balanced_steps(run: SpmdRun) -> list[Any]:
    """The steps after the first plan switched in (all but the first for static)."""
    later = [s for s in run.steps[1:] if s.plan_version >= 1]
    return later if len(later) >= 2 else run.steps[1:]


def balance_row(label: str, run: SpmdRun, base: SpmdRun | None) -> dict[str, Any]:
    steps = balanced_steps(run)
    per_mb = [1.0 / b for s in steps for b in (s.balancedness or [])]
    med = statistics.median(s.seconds for s in steps)
    out = {
        "mode": label,
        "steps_used": [s.step for s in steps],
        "median_max_over_mean": statistics.median(per_mb),
        "max_max_over_mean": max(per_mb),
        "median_worst_layer": statistics.median(s.imbalance for s in steps),
        "median_static_same_tokens": statistics.median(s.imbalance_static or 0.0 for s in steps),
        "median_floor": statistics.median(floor(run, steps)),
        **within_and_floor(run, steps),
        "median_seconds": med,
        "median_balance_fraction": statistics.median(s.balance_seconds / s.seconds for s in steps),
        "median_replicas": statistics.median(s.replicas for s in steps),
        "median_fanout_mb": statistics.median(s.fanout_bytes for s in steps) / 1e6,
        "median_token_mb": statistics.median(s.cross_dc_token_bytes for s in steps) / 1e6,
        "per_microbatch": per_mb,
        "seconds": [s.seconds for s in run.steps],
        "imbalance": [s.imbalance for s in run.steps],
        "plan_versions": [s.plan_version for s in run.steps],
    }
    if base is not None:
        out["speedup_vs_static"] = statistics.median(s.seconds for s in balanced_steps(base)) / med
    return out


def bench(args: argparse.Namespace) -> dict[str, Any]:
    lm = LMConfig(num_experts=EXPERTS, batch=args.batch)
    out: dict[str, Any] = {"balance": [], "links": [], "calibrations": [], "migration": []}
    with SharedCluster(3) as cluster:
        print(f"cluster up in {cluster.start_seconds:.1f}s", flush=True)
        if not args.quick:
            run_spmd(settings(topology(3, 1e4, 0.0), lm, "static", args), 2)  # warm-up, unused
        for gbps in (
            args.migration_gbps if args.migration else []
        ):  # background vs boundary migration, same run
            group = {}
            for mig in ("boundary", "background"):
                st = settings(topology(3, gbps), lm, "hybrid + fast loop", args, mig, every=2)
                group[mig] = run_spmd(st, args.migration_steps)
            ref = [s.loss for s in group["boundary"].steps]
            for run in group.values():
                r = {"gbps": gbps, **migration_row("hybrid + fast loop", run)}
                r["max_loss_diff_vs_boundary"] = max(
                    abs(a - b) / abs(b) for a, b in zip(r["losses"], ref, strict=True)
                )
                out["migration"].append(r)
                print(f"  {_mline(r)}", flush=True)
        topo = topology(3, args.gbps)
        runs = {m: run_spmd(settings(topo, lm, m, args), args.steps) for m in MODES}
        for mode, run in runs.items():
            r = balance_row(mode, run, runs["static"])
            if mode == "hybrid + fast loop":
                r["replay"] = replay_within(run, balanced_steps(run))
            out["balance"].append(r)
            print(f"  {args.gbps:g} Gbit/s {_bline(r)}", flush=True)
        for dcs in args.dcs if args.links else []:
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


def _mline(r: dict[str, Any]) -> str:
    return (
        f"{r['gbps'] * 1000:g} Mbit/s {r['migration']:10s} {r['switches']} switches: "
        f"{r['critical_seconds'] * 1e3:.1f} ms on the critical path (wait "
        f"{r['wait_seconds'] * 1e3:.1f} ms), {r['boundary_mb']:.3f} MB at the boundary, "
        f"{r['background_mb']:.3f} MB in the background; steps touched +"
        f"{r['step_extra_seconds']:.3f} s per switch"
    )


def _bline(r: dict[str, Any]) -> str:
    return (
        f"{r['mode']:22s} max/mean {r['median_max_over_mean']:.3f} (within DC "
        f"{r['median_within_dc']:.3f}, floor "
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
        "| inter-DC | migration | switches | critical path ms / switch | of it waiting ms "
        "| cross-DC MB at the boundary / switch | cross-DC MB in the background / switch "
        "| steps touched, s over the others / switch | median other step s "
        "| max loss diff vs boundary |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result.get("migration", []):
        lines.append(
            f"| {r['gbps'] * 1000:g} Mbit/s | {r['migration']} | {r['switches']} "
            f"| {r['critical_seconds'] * 1e3:.1f} | {r['wait_seconds'] * 1e3:.1f} "
            f"| {r['boundary_mb']:.3f} | {r['background_mb']:.3f} "
            f"| {r['step_extra_seconds']:+.3f} | {r['median_other_seconds']:.3f} "
            f"| {r['max_loss_diff_vs_boundary']:.1e} |"
        )
    lines += [
        "",
        "| mode | within DC max/mean, median | floor, median | excess assignments of the "
        "busiest DC / step | WAN MB to route them / step | s at 1 Gbit/s | s at 100 Mbit/s "
        "| s at 20 Mbit/s | expert s it would save / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["balance"]:
        w = r["floor_wan_seconds"]
        lines.append(
            f"| {r['mode']} | {r['median_within_dc']:.3f} | {r['median_floor_grid']:.3f} "
            f"| {r['floor_excess_assignments']:.0f} | {r['floor_wan_bytes'] / 1e6:.3f} "
            f"| {w['1']:.4f} | {w['0.1']:.4f} | {w['0.02']:.3f} "
            f"| {r['floor_saved_seconds']:.4f} |"
        )
    lines += [
        "",
        "| mode | max/mean per microbatch and layer, median | max | worst layer per step, "
        "median | static EP on the same tokens | floor (max DC mean / mean) | median s/step "
        "| vs static | balancing % of step | replicas/step | fan-out MB/step "
        "| cross-DC token MB/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["balance"]:
        lines.append(
            f"| {r['mode']} | {r['median_max_over_mean']:.3f} | {r['max_max_over_mean']:.3f} "
            f"| {r['median_worst_layer']:.3f} | {r['median_static_same_tokens']:.2f} "
            f"| {r['median_floor']:.3f} | {r['median_seconds']:.3f} "
            f"| {r.get('speedup_vs_static', 1.0):.2f}x | {100 * r['median_balance_fraction']:.1f} "
            f"| {r['median_replicas']:g} | {r['median_fanout_mb']:.2f} "
            f"| {r['median_token_mb']:.3f} |"
        )
    for r in result["balance"]:
        if "replay" not in r:
            continue
        lines += [
            "",
            f"Inside DCs, replayed on the `{r['mode']}` run's own counts and plans (replay of "
            f"the settings it ran = what its ranks computed: {r['replay']['matches']}):",
            "",
            "| solve inside each DC | max/mean, median | within DC, median | floor, median |",
            "|---|---:|---:|---:|",
        ]
        for name, v in r["replay"]["variants"].items():
            lines.append(
                f"| {name} | {v['max_over_mean']:.3f} | {v['within_dc']:.3f} | {v['floor']:.3f} |"
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
    p.add_argument("--steps", type=int, default=12, help="steps per balance row")
    p.add_argument("--every", type=int, default=3, help="steps between plans")
    p.add_argument("--gbps", type=float, default=1.0, help="inter-DC Gbit/s of the balance rows")
    p.add_argument("--slow-gbps", type=float, default=0.02, help="inter-DC Gbit/s, part 3")
    p.add_argument("--dcs", default="2,3", help="DC counts of part 3")
    p.add_argument("--microbatches", default="1,4", help="microbatches per step, part 3")
    p.add_argument("--link-steps", type=int, default=5, help="steps per part-3 row")
    p.add_argument("--calib-steps", type=int, default=4, help="steps per calibration run")
    p.add_argument("--batch", type=int, default=LMConfig().batch, help="sequences per rank")
    p.add_argument("--corpus-bytes", type=int, default=300_000)
    p.add_argument("--migration-steps", type=int, default=10, help="steps per migration row")
    p.add_argument(
        "--no-links", dest="links", action="store_false", help="leave out part 3 (20 Mbit/s rows)"
    )
    p.add_argument(
        "--no-migration",
        dest="migration",
        action="store_false",
        help="leave out part 0 (background vs boundary migration rows)",
    )
    p.add_argument(
        "--migration-gbps", default="1,0.02", help="inter-DC Gbit/s of the migration rows"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: tiny batch, few steps")
    p.add_argument("--json", type=Path, help="write every measurement here")
    args = p.parse_args(argv)
    args.dcs = [int(x) for x in args.dcs.split(",")]
    args.microbatches = [int(x) for x in args.microbatches.split(",")]
    args.migration_gbps = [float(x) for x in args.migration_gbps.split(",")]
    if args.quick:
        args.steps, args.every, args.link_steps, args.calib_steps = 5, 2, 3, 3
        args.batch, args.dcs, args.microbatches = 4, [2], [2]
        args.migration_steps, args.migration_gbps = 6, [1.0]
    if min(args.steps, args.link_steps, args.calib_steps) < 3:
        p.error("--steps, --link-steps and --calib-steps must be >= 3")
    return run_bench(args, bench, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
