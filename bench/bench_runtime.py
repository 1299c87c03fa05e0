"""Runtime benchmark (issue 4): the demo model training on Ray across 2 and 3 shaped DCs.

Setting: the demo's model and batch (``LMConfig()``: byte-level MoE LM, 2 MoE
layers of 12 experts, top-2, hidden 32, 16 x 64 tokens per rank per step) on
``D`` DCs x 2 ranks, each DC able to hold every expert (``12 / 2D`` master and
``6 - 12 / 2D`` spare slots per rank), inter-DC links of 1 Gbit/s, 100 Mbit/s
and 20 Mbit/s with 20 ms latency through the link shaper. One local Ray cluster
per DC count; every run starts afresh on it (``Runtime.reset``: initial weights,
no plan) with the same seed, so the losses of all policies must match.

Per run: ``--steps`` steps; the controller plans after step 0 and every
``--every`` steps (eplb and hybrid with ``period = window = --every``); step 0
runs on static EP for every policy and is not measured. ``hybrid-bf16`` is
``hybrid`` with its transfer encoding at 2 bytes per weight and gradient:
replica refreshes, copies and replica gradients travel in bfloat16 (masters,
Adam state and dense gradients stay float32), so its losses differ from
static's a little. ``--repeats`` rounds per (DCs, bandwidth), the policy order
rotated each round; medians pool the rounds' measured steps, and ratios are to
``static``'s pooled median of the same group.

Calibration (before every round, stated in the output; one unused warm-up run
after the cluster starts): static on free links (1e4 Gbit/s, 0 ms) for
``--calib-steps`` steps. From it the cost model's two machine constants: the
per-rank expert compute rate ``F`` (expert FLOPs over the seconds the ranks
spent in their experts) and the fixed time ``o`` of one Ray round (what the
measured step has beyond the model with ``o = 0``, over the Ray rounds the step
ran: ``StepLayout.rounds``, 20 for static). ``hybrid`` plans with the
calibrated model (its ``cost`` setting). Prediction per measured step:
:func:`expertmesh.planner.stepmodel.training_step_cost` on the step's realized
token streams (routes and distinct tokens crossing each DC pair, as counted by
the workers), the placement and Ray rounds (``StepLayout``) it ran on and the
plan's encoding; no measured time enters it except through ``F`` and ``o``.
Reported: median predicted vs median measured.

    make bench-runtime      # or: python bench/bench_runtime.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
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
for _root in ("controller", "workers", "proto"):
    if str(REPO / _root) not in sys.path:
        sys.path.insert(0, str(REPO / _root))

from expertmesh.controller.core import Trigger  # noqa: E402 (after the source roots)
from expertmesh.planner import Placement, Topology, available_policies  # noqa: E402
from expertmesh.planner.costmodel import CostSettings, TransferEncoding  # noqa: E402
from expertmesh.planner.static import static_placement  # noqa: E402
from expertmesh.planner.stepmodel import StepLayout, training_step_cost  # noqa: E402
from expertmesh.planner.traffic import traffic_from_route  # noqa: E402
from expertmesh.runtime.cluster import Runtime, RuntimeSettings  # noqa: E402
from expertmesh.workers.model import DenseModel, LMConfig  # noqa: E402

POLICIES = ("static", "eplb", "quota", "hybrid", "hybrid-bf16")
BF16 = TransferEncoding(weight_bytes=2, grad_bytes=2)  # hybrid-bf16's expert streams
FREE_GBPS, LATENCY_MS = 1e4, 20.0


def _topology(dcs: int, gbps: float, latency_ms: float, experts: int) -> Topology:
    ranks = 2 * dcs
    if experts % ranks:
        raise ValueError(f"{experts} experts do not split over {ranks} ranks")
    masters = experts // ranks
    spare = max(experts // 2 - masters, 0)  # a DC (2 ranks) can hold every expert
    return Topology.generate(dcs, 2, masters=masters, spare=spare).with_inter_dc(gbps, latency_ms)


def _policy(label: str) -> str:
    """The registered policy a row label runs (``hybrid-bf16``: ``hybrid``)."""
    return label.removesuffix("-bf16")


def _encoding(label: str) -> TransferEncoding | None:
    return BF16 if label.endswith("-bf16") else None


def _policy_settings(label: str, every: int, cost: CostSettings | None) -> dict[str, Any]:
    policy = _policy(label)
    if policy == "eplb":
        return {"period": every, "window": every}
    if policy == "hybrid":
        out: dict[str, Any] = {"period": every, "window": every}
        if cost is not None:
            out["cost"] = cost.model_dump()
        if _encoding(label) is not None:
            out["encoding"] = BF16.model_dump()
        return out
    return {}


@dataclasses.dataclass
class Run:
    """One policy's run: per step measurements and the model's inputs."""

    steps: list[Any]  # StepResult
    stats: list[list[dict[str, Any]]]  # per step, per rank RankState.stats()
    placements: list[list[Placement]]  # per step, per layer: what the step ran on
    layouts: list[StepLayout]  # per step: the rounds it ran
    seconds: float
    encoding: TransferEncoding | None = None


def _run(rt: Runtime, settings: RuntimeSettings, steps: int) -> Run:
    rt.reset(settings)
    topo, lm = Topology.from_dict(settings.topology), settings.lm
    start = static_placement(
        topo.num_ranks, topo.slots_per_rank, lm.num_experts, topo.masters_per_rank
    )
    current = [start] * lm.num_layers
    enc = settings.policy_settings.get("encoding")
    out = Run([], [], [], [], 0.0, None if enc is None else TransferEncoding(**enc))
    t0 = time.perf_counter()
    for _ in range(steps):
        out.placements.append(current)
        out.layouts.append(rt.layout or StepLayout.full(lm.num_layers))
        out.steps.append(rt.run_step())
        out.stats.append(rt.last_stats)
        plan = rt.committed_plan()
        if plan is not None:
            current = [Placement(np.asarray(p), np.asarray(m)) for p, m, _ in plan]
    out.seconds = time.perf_counter() - t0
    return out


def _traffic(stats: list[dict[str, Any]], layer: int, topo: Topology, top_k: int) -> Any:
    """Exact token streams of one layer of one step, from what the workers dispatched."""
    route = np.concatenate([s["routed"][layer] for s in stats])  # [N, 4]
    load = np.stack([s["load"][layer] for s in stats])  # [R, E]
    tr = traffic_from_route(route, load, topo, top_k)
    cross = np.zeros((topo.num_dcs, topo.num_dcs))  # [D, D] distinct tokens src DC -> dst DC
    for s in stats:
        cross[topo.rank_dc[s["rank"]]] += s["crossings"][layer]
    return dataclasses.replace(tr, pair_crossings=cross[tr.pair_src, tr.pair_dst])


def _predict(run: Run, topo: Topology, lm: LMConfig, dense: int, cost: CostSettings) -> list[float]:
    """Modeled seconds of every step of ``run``."""
    out = []
    for stats, placements, layout in zip(run.stats, run.placements, run.layouts, strict=True):
        traffic = [_traffic(stats, layer, topo, lm.top_k) for layer in range(lm.num_layers)]
        t = training_step_cost(
            topo,
            lm.spec(),
            traffic,
            placements,
            dense_params=dense,
            settings=cost,
            encoding=run.encoding,
            layout=layout,
        )
        out.append(t.seconds)
    return out


def _calibrate(run: Run, topo: Topology, lm: LMConfig, dense: int) -> CostSettings:
    """``F`` from the ranks' expert seconds, then ``o`` from the step times (steps >= 1)."""
    spec = lm.spec()
    per_assignment = 6.0 * spec.expert_params  # forward 2P, backward 4P FLOPs
    work = sum(float(np.sum(s["computed"])) for st in run.stats[1:] for s in st)
    secs = sum(float(np.sum(s["expert_seconds"])) for st in run.stats[1:] for s in st)
    flops = work * per_assignment / secs
    base = CostSettings(flops_per_second=flops)
    model = _predict(run, topo, lm, dense, base)
    per_round = statistics.median(
        (r.step_seconds - m) / layout.rounds
        for r, m, layout in zip(run.steps[1:], model[1:], run.layouts[1:], strict=True)
    )
    return base.model_copy(update={"message_seconds": max(per_round, 0.0)})


def _loss_gap(run: Run, base: Run) -> float:
    a = np.array([s.loss for s in run.steps])
    b = np.array([s.loss for s in base.steps])
    return float(np.max(np.abs(a - b) / np.abs(b)))


def _fmt_gbps(g: float) -> str:
    return f"{g:g} Gbit/s" if g >= 1 else f"{g * 1000:g} Mbit/s"


def bench(args: argparse.Namespace) -> dict[str, Any]:
    lm = LMConfig(batch=args.batch)
    print(
        f"model: {lm.num_layers} MoE layers x {lm.num_experts} experts, top-{lm.top_k}, hidden "
        f"{lm.hidden}, ffn {lm.ffn_hidden}, {lm.batch} x {lm.seq_len} tokens per rank per step; "
        f"{args.steps} steps per run (step 0 not measured), {args.repeats} rounds, plans every "
        f"{args.every} steps; machine load {os.getloadavg()[0]:.1f} (2 cores)",
        flush=True,
    )
    dense = sum(p.numel() for p in DenseModel(lm).parameters())
    have = set(available_policies())
    policies = [p for p in args.policies if _policy(p) in have]
    rows: list[dict[str, Any]] = []
    calibrations: list[dict[str, Any]] = []
    for dcs in args.dcs:
        free = _topology(dcs, FREE_GBPS, 0.0, lm.num_experts)
        base = RuntimeSettings(
            topology=free.to_dict(),
            lm=lm,
            policy="static",
            trigger=Trigger(mode="every_n", every=args.every),
            corpus_bytes=args.corpus_bytes,
        )
        t_up = time.perf_counter()
        with Runtime(base) as rt:
            print(f"{dcs} DCs: cluster up in {time.perf_counter() - t_up:.1f}s", flush=True)
            warm = _run(rt, base, args.calib_steps)  # first runs on fresh workers are slower
            print(
                f"  warm-up (not used): static on free links, median step "
                f"{statistics.median(s.step_seconds for s in warm.steps[1:]):.3f}s",
                flush=True,
            )
            for gbps in args.gbps:
                topo = _topology(dcs, gbps, args.latency_ms, lm.num_experts)
                done: dict[str, list[tuple[Run, list[float]]]] = {p: [] for p in policies}
                for rep in range(args.repeats):
                    cost = _calibration(rt, base, free, lm, dense, args, calibrations, gbps)
                    order = policies[rep % len(policies) :] + policies[: rep % len(policies)]
                    for policy in order:
                        settings = base.model_copy(
                            update={
                                "topology": topo.to_dict(),
                                "policy": _policy(policy),
                                "policy_settings": _policy_settings(policy, args.every, cost),
                            }
                        )
                        run = _run(rt, settings, args.steps)
                        done[policy].append((run, _predict(run, topo, lm, dense, cost)))
                for policy in args.policies:
                    if _policy(policy) not in have:
                        rows.append({"dcs": dcs, "gbps": gbps, "policy": policy, "missing": True})
                    else:
                        rows.append(_row(dcs, gbps, policy, done))
                    print("   ", _line(rows[-1]), flush=True)
    return {"rows": rows, "calibrations": calibrations, "lm": lm.model_dump()}


def _calibration(
    rt: Runtime,
    base: RuntimeSettings,
    free: Topology,
    lm: LMConfig,
    dense: int,
    args: argparse.Namespace,
    out: list[dict[str, Any]],
    gbps: float,
) -> CostSettings:
    calib = _run(rt, base, args.calib_steps)
    cost = _calibrate(calib, free, lm, dense)
    cal = {
        "dcs": free.num_dcs,
        "before_gbps": gbps,
        "steps": args.calib_steps,
        "median_step_seconds": statistics.median(s.step_seconds for s in calib.steps[1:]),
        "flops_per_second": cost.flops_per_second,
        "message_seconds": cost.message_seconds,
        "load_avg": os.getloadavg()[0],
    }
    out.append(cal)
    print(
        f"  calibration ({_fmt_gbps(gbps)} round): static on free links, median step "
        f"{cal['median_step_seconds']:.3f}s -> F = {cost.flops_per_second / 1e9:.2f} GFLOP/s "
        f"per rank, o = {cost.message_seconds * 1e3:.1f} ms per Ray round "
        f"(load {cal['load_avg']:.1f})",
        flush=True,
    )
    return cost


def _row(
    dcs: int, gbps: float, policy: str, done: dict[str, list[tuple[Run, list[float]]]]
) -> dict[str, Any]:
    """Pooled medians of every repeat's measured steps (step 0 left out) and predictions."""
    runs = done[policy]
    steps = [s for run, _ in runs for s in run.steps[1:]]
    measured = [s.step_seconds for s in steps]
    predicted = [x for _, pred in runs for x in pred[1:]]
    med, pred = statistics.median(measured), statistics.median(predicted)
    row: dict[str, Any] = {
        "dcs": dcs,
        "gbps": gbps,
        "policy": policy,
        "repeats": len(runs),
        "median_step_seconds": med,
        "predicted_seconds": pred,
        "predicted_over_measured": pred / med,
        "rounds_per_step": statistics.median(
            layout.rounds for run, _ in runs for layout in run.layouts[1:]
        ),
        "step_seconds": [[s.step_seconds for s in run.steps] for run, _ in runs],
        "predicted": [p for _, p in runs],
        "losses": [[s.loss for s in run.steps] for run, _ in runs],
        "token_mb_per_step": statistics.median(s.cross_dc_token_bytes for s in steps) / 1e6,
        "weight_mb_per_step": statistics.median(s.cross_dc_weight_bytes for s in steps) / 1e6,
        "migration_mb_per_run": statistics.median(
            sum(s.cross_dc_migration_bytes for s in run.steps) for run, _ in runs
        )
        / 1e6,
        "errors": [s.error for run, _ in runs for s in run.steps if s.error],
    }
    static = done.get("static")
    if static:
        base = statistics.median(s.step_seconds for run, _ in static for s in run.steps[1:])
        row["speedup_vs_static"] = base / med
        row["loss_rel_diff_vs_static"] = max(
            _loss_gap(run, ref) for (run, _), (ref, _) in zip(runs, static, strict=True)
        )
    return row


def _line(r: dict[str, Any]) -> str:
    if r.get("missing"):
        return f"{r['dcs']} DCs {_fmt_gbps(r['gbps'])} {r['policy']}: not registered"
    return (
        f"{r['dcs']} DCs {_fmt_gbps(r['gbps'])} {r['policy']:11s} median "
        f"{r['median_step_seconds']:.3f}s  x{r.get('speedup_vs_static', 1.0):.2f} vs static  "
        f"predicted {r['predicted_seconds']:.3f}s ({r['predicted_over_measured']:.2f})  "
        f"loss diff {r.get('loss_rel_diff_vs_static', 0.0):.1e}  WAN "
        f"{r['token_mb_per_step']:.2f} MB tokens {r['weight_mb_per_step']:.2f} MB weights  "
        f"{r['rounds_per_step']:g} Ray rounds"
    )


def markdown(result: dict[str, Any]) -> str:
    head = (
        "| DCs | inter-DC | policy | median step s | vs static | predicted s | pred / meas "
        "| max loss diff vs static | WAN tokens MB/step | WAN weights MB/step | migration MB/run "
        "| Ray rounds/step |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in result["rows"]:
        if r.get("missing"):
            lines.append(
                f"| {r['dcs']} | {_fmt_gbps(r['gbps'])} | {r['policy']} | not registered "
                "| | | | | | | | |"
            )
            continue
        lines.append(
            f"| {r['dcs']} | {_fmt_gbps(r['gbps'])} | {r['policy']} "
            f"| {r['median_step_seconds']:.3f} | {r.get('speedup_vs_static', 1.0):.2f}x "
            f"| {r['predicted_seconds']:.3f} | {r['predicted_over_measured']:.2f} "
            f"| {r.get('loss_rel_diff_vs_static', 0.0):.1e} | {r['token_mb_per_step']:.2f} "
            f"| {r['weight_mb_per_step']:.2f} | {r['migration_mb_per_run']:.2f} "
            f"| {r['rounds_per_step']:g} |"
        )
    cal = "\n".join(
        f"- {c['dcs']} DCs, {_fmt_gbps(c['before_gbps'])} round: static on free links, median step "
        f"{c['median_step_seconds']:.3f} s -> F = {c['flops_per_second'] / 1e9:.2f} GFLOP/s "
        f"per rank, o = {c['message_seconds'] * 1e3:.1f} ms per Ray round "
        f"(load {c['load_avg']:.1f})"
        for c in result["calibrations"]
    )
    return head + "\n".join(lines) + "\n\nCalibration (same run):\n\n" + cal + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dcs", default="2,3", help="DC counts (default 2,3)")
    p.add_argument("--gbps", default="1,0.1,0.02", help="inter-DC Gbit/s (default 1,0.1,0.02)")
    p.add_argument("--latency-ms", type=float, default=LATENCY_MS, help="inter-DC latency")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--steps", type=int, default=9, help="steps per run (step 0 not measured)")
    p.add_argument("--every", type=int, default=4, help="steps between plans")
    p.add_argument("--calib-steps", type=int, default=5, help="steps of each calibration run")
    p.add_argument(
        "--repeats", type=int, default=3, help="rounds per (DCs, bandwidth), policy order rotated"
    )
    p.add_argument("--corpus-bytes", type=int, default=1_000_000)
    p.add_argument(
        "--batch", type=int, default=LMConfig().batch, help="sequences per rank per step (demo: 16)"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 3 DCs, 20 Mbit/s, 4 steps")
    p.add_argument("--json", type=Path, help="write every measurement here")
    args = p.parse_args()
    args.dcs = [int(x) for x in args.dcs.split(",")]
    args.gbps = [float(x) for x in args.gbps.split(",")]
    args.policies = [x for x in args.policies.split(",") if x]
    if args.quick:
        args.dcs, args.gbps, args.steps, args.calib_steps, args.repeats = [3], [0.02], 4, 3, 1
    if args.steps < 2 or args.calib_steps < 2 or args.repeats < 1:
        p.error("--steps and --calib-steps must be >= 2 (step 0 is not measured), --repeats >= 1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    result = bench(args)
    result["seconds"] = time.perf_counter() - t0
    result["load_avg"] = [load0, os.getloadavg()[0]]
    result["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    print()
    print(markdown(result))
    print(
        f"total {result['seconds']:.0f}s; load average {load0:.1f} at start, "
        f"{result['load_avg'][1]:.1f} at end (2 cores)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
