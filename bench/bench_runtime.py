"""Runtime benchmark (issues 4 and 11): the demo model training on the SPMD data plane
(``SpmdRuntime``: one worker actor per rank runs its own loop over gloo; the driver
submits one call per worker per ``train``) across 2 and 3 shaped DCs, beside the old
Ray-rounds plane's driver overhead as last measured (``oldplane_record.json``: the old
plane is gone; the record names the commit and command that measured it).

Setting: the demo's model and batch (``LMConfig()``: 2 MoE layers of 12 experts, top-2,
hidden 32, 16 x 64 tokens per rank per step) on ``D`` DCs x 2 ranks, each DC able to hold
every expert (``12 / 2D`` master and ``6 - 12 / 2D`` spare slots per rank), inter-DC links
of 1 Gbit/s, 100 Mbit/s and 20 Mbit/s with 20 ms latency through the link shaper, the
fast loop off (``balance=False``: the plans' routes split tokens; bench_balance_train.py
measures the fast loop). One local Ray cluster for the whole run (a labeled node per DC);
every row is a fresh runtime on it (new workers, initial weights, same seed).

1. **Overhead**: per step, the workers' time submitting their fire-and-forget report
   (``ray_seconds``, the only Ray call on the data path) and all time outside forward,
   backward and gradient sync (``seconds - step_seconds``: plan switch with migration,
   report), as fractions of the end-to-end step (``seconds``), and the driver's wall and
   CPU around ``train()`` beyond the steps'; beside them the old plane's figures, static
   at 1 Gbit/s, from ``oldplane_record.json`` (not re-run).
2. **Policies**: ``--steps`` steps per row, plans after step 0 and every ``--every``
   steps; medians of ``seconds`` (end to end: everything included) over the steps that
   ran on a plan the controller made (from the first step whose plan version differs from
   step 0's: ``expertmesh.sim.replay.planned_from``; before it every row runs the initial
   placement, and a median over both phases is an order statistic of a two-valued
   mixture); the median over every step but the first is kept beside it
   (``median_all_seconds``). "vs static" is static's median of the same group and steps
   over the row's. ``hybrid-bf16``: replica weights and gradients travel in bfloat16.
3. **Prediction**: ``expertmesh sim replay`` of the trace.npz and plans.npz every row's
   runtime wrote (``--trace-dir``/``<D>dc-<speed>-<policy>/``) with the constants of
   ``--trace-dir``/``cal-<D>dc-<speed>.yaml``: ``planner.stepmodel.spmd_step_cost`` per
   step, ``a * tokens + c * collectives + crossing collectives * latency + per crossing
   collective its busiest pair's bytes / bandwidth, summed``, the collectives from the
   plan each step ran on (a background plan switch: one transfer of the moved masters
   and a sync that switches), the bytes of every collective as the workers counted them;
   ``a`` and ``c`` calibrated per group (DC count and bandwidth) on static over free
   links (1e4 Gbit/s, 0 ms) at the full batch and a quarter of it, one run of each just
   before and one just after the group, their steps pooled; then per row, both times
   the row's drift factor: a full-batch static run on free links (a probe) between each
   two rows of the group, and the row's factor the pooled median step (less links) of
   the probes on either side of it over the group's full-batch one (a machine that
   slows down within the group slows the row and its probes alike; the constants'
   split between tokens and collectives stays the group's). Each row's constants go to
   ``cal-<D>dc-<speed>-<policy>.yaml``. Median predicted vs median measured over the
   same steps; beside it the workers' own counts (collectives, seconds waiting in the
   link shaper) against the model's. The group's calibration is checked on its own runs
   (``spmdbench.check_calibration``, never on a row's prediction): the full batch at
   least 1.15x the quarter batch's median step before, after and pooled, and a batch
   size's before and after runs within 1.40x of each other. A group that fails is run
   whole again (calibration before, rows, probes, calibration after; attempt ``n`` under
   ``attempt-<n>/``), at most ``--calibration-attempts`` (3) times in all; the first
   attempt that passes is the group, the rejected ones are kept under ``rejected`` with
   their faults, and with none passing the group is under ``failed``, without rows.
4. Tokens per second per worker: tokens a rank trains per step over the median step.

Every run keeps its trace: the rows' in ``<D>dc-<speed>-<policy>/``, the calibration
runs' and probes' in ``calibration/`` (the JSON names them), each with every rank's CPU
seconds and shaper waits per step (``rank_cpu_seconds``, ``rank_shaped_seconds``). So
``--repredict JSON`` fits the constants and replays every row again with the current
model from those files alone, in seconds, the measurements as recorded, and runs the
calibration check over every group again (``flagged``: those it fails). A group whose
runs fail is recorded under ``failed``; the other groups still run, and the JSON is
rewritten after every group.

    make bench-runtime      # or: python bench/bench_runtime.py [--quick] [--json out.json]
    python bench/bench_runtime.py --repredict out/bench-runtime.json --json out/re.json
    expertmesh sim replay --trace out/bench-runtime/2dc-1gbps-hybrid/trace.npz \
        --plan out/bench-runtime/2dc-1gbps-hybrid/plans.npz \
        --calibration out/bench-runtime/cal-2dc-1gbps-hybrid.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
for _root in ("controller", "workers", "proto", "bench"):
    if str(REPO / _root) not in sys.path:
        sys.path.insert(0, str(REPO / _root))

from runtime_tables import fmt_gbps, line, markdown  # noqa: E402
from spmdbench import (  # noqa: E402
    Calibration,
    Replay,
    Run,
    SharedCluster,
    SpmdRun,
    calibrate,
    check_calibration,
    replay_run,
    residual,
    run_bench,
    run_spmd,
    tokens_per_rank,
)

from expertmesh.controller.core import Trigger  # noqa: E402 (after the source roots)
from expertmesh.formats import read_trace  # noqa: E402
from expertmesh.planner import Topology, available_policies  # noqa: E402
from expertmesh.runtime.settings import RuntimeSettings  # noqa: E402
from expertmesh.workers.model import LMConfig  # noqa: E402

POLICIES = ("static", "eplb", "quota", "hybrid", "hybrid-bf16")
BF16 = {"weight_bytes": 2, "grad_bytes": 2}
FREE_GBPS, LATENCY_MS = 1e4, 20.0
OLD_PLANE = Path(__file__).with_name("oldplane_record.json")  # the removed plane's last figures


def topology(dcs: int, gbps: float, latency_ms: float, experts: int) -> Topology:
    ranks = 2 * dcs
    if experts % ranks:
        raise ValueError(f"{experts} experts do not split over {ranks} ranks")
    masters = experts // ranks
    spare = max(experts // 2 - masters, 0)  # a DC (2 ranks) can hold every expert
    return Topology.generate(dcs, 2, masters=masters, spare=spare).with_inter_dc(gbps, latency_ms)


def policy_settings(label: str, every: int) -> dict[str, Any]:
    policy = label.removesuffix("-bf16")
    out: dict[str, Any] = {}
    if policy in ("eplb", "hybrid"):
        out = {"period": every, "window": every}
    if label.endswith("-bf16"):
        out["encoding"] = BF16
    return out


def settings(
    topo: Topology,
    lm: LMConfig,
    label: str,
    args: argparse.Namespace,
    layout: Literal["static", "replicated"] = "static",
) -> RuntimeSettings:
    """A row's runtime; ``layout="replicated"`` (calibration of ``h``): the replicated
    initial placement, never re-planned (the DCs' leads report their load once per
    4,096 steps, so the controller never has a complete load to plan on)."""
    return RuntimeSettings(
        topology=topo.to_dict(),
        lm=lm,
        policy=label.removesuffix("-bf16"),
        policy_settings=policy_settings(label, args.every),
        trigger=Trigger(mode="every_n", every=args.every),
        balance=False,
        corpus_bytes=args.corpus_bytes,
        layout=layout,
        load_window=0 if layout == "static" else 4096,
    )


def row(run: SpmdRun, cal: Calibration, static: SpmdRun | None) -> dict[str, Any]:
    """Medians over the measured steps (the first left out), the replay's prediction and
    the workers' own counts beside them."""
    steps = run.measured()
    rep = replay_run(run, cal.constants(), skip=None)  # from the first step on its plans
    k = rep.skip
    med = run.median("seconds", k)
    extra = rep_meta(run)
    out: dict[str, Any] = {
        "policy": run.settings.policy
        + ("-bf16" if "encoding" in run.settings.policy_settings else ""),
        "measured_from": k,
        "median_seconds": med,
        "median_all_seconds": run.median("seconds"),  # steps 1-: the initial placement too
        "median_step_seconds": run.median("step_seconds", k),
        **prediction(rep, med, run.median("seconds")),
        **measured_split(extra, k, os.cpu_count() or 1),
        "measured_collectives": statistics.median(extra["collectives"][k:]),
        "measured_shaped_seconds": statistics.median(extra["shaped_seconds"][k:]),
        "ray_fraction": statistics.median((s.ray_seconds or 0.0) / s.seconds for s in steps),
        "outside_fraction": statistics.median(
            (s.seconds - s.step_seconds) / s.seconds for s in steps
        ),
        # the driver's wall around train() beyond the steps' own: starting each chunk,
        # the checkpoints between chunks, waiting for the last reports
        "driver_fraction": max(run.train_seconds - sum(s.seconds or 0.0 for s in run.steps), 0.0)
        / run.train_seconds,
        "driver_cpu_fraction": run.driver_cpu_seconds / run.train_seconds,
        "tokens_per_second_per_worker": tokens_per_rank(run.settings) / med,
        "token_mb_per_step": statistics.median(s.cross_dc_token_bytes for s in steps) / 1e6,
        "weight_mb_per_step": statistics.median(s.cross_dc_weight_bytes for s in steps) / 1e6,
        "migration_mb_per_run": sum(s.cross_dc_migration_bytes for s in run.steps) / 1e6,
        "plan_versions": sorted({s.plan_version for s in run.steps}),
        "backend": run.steps[-1].backend,
        "start_seconds": run.start_seconds,
        "trace_dir": str(run.trace_dir),
        "seconds": [s.seconds for s in run.steps],
        "step_seconds": [s.step_seconds for s in run.steps],
        "ray_seconds": [s.ray_seconds for s in run.steps],
        "losses": [s.loss for s in run.steps],
        "control_seconds": [s.control_seconds for s in run.steps],
        "errors": [s.error for s in run.steps if s.error],
    }
    if static is not None:
        out["speedup_vs_static"] = static.median("seconds", k) / med
        out["loss_rel_diff_vs_static"] = max(
            abs(a.loss - b.loss) / abs(b.loss) for a, b in zip(run.steps, static.steps, strict=True)
        )
    return out


def prediction(rep: Replay, median: float, median_all: float) -> dict[str, Any]:
    """A row's prediction fields from its replay, against the measured ``median`` (steps
    ``rep.skip``-) and ``median_all`` (steps 1-)."""
    k = rep.skip
    return {
        "predicted_seconds": rep.predicted_median,
        "predicted_over_measured": rep.predicted_median / median,
        "predicted_all_over_measured": statistics.median(rep.predicted[1:].tolist()) / median_all,
        "predicted_parts": {
            name: statistics.median(v[k:].tolist()) for name, v in rep.parts.items()
        },
        "model_collectives": statistics.median(rep.counts["collectives"][k:].tolist()),
        "model_crossing": statistics.median(rep.counts["crossing"][k:].tolist()),
        "model_copies": statistics.median(rep.counts["copies"][k:].tolist()),
        "predicted": rep.predicted.tolist(),
    }


def repredict(result: dict[str, Any], root: Path) -> dict[str, Any]:
    """A recorded run (``--json``) predicted again from the traces it wrote under ``root``
    (its rows', calibration runs' and probes'): the constants fitted and every row
    replayed with the current model, the measurements as recorded. Seconds, not a rerun."""
    out = {**result, "groups": [], "calibrations": [], "flagged": []}
    cals = {(c["dcs"], c["gbps"]): c for c in result["calibrations"]}
    for g in result["groups"]:
        info = cals[(g["dcs"], g["gbps"])]
        runs = info.get("runs")
        if runs is None:
            raise ValueError(
                f"{g['dcs']} DCs {fmt_gbps(g['gbps'])}: the record names no calibration runs "
                "(a run before --repredict existed): re-run it"
            )
        before, after = [root / r for r in runs["before"]], [root / r for r in runs["after"]]
        cal, checked = _calibrate_checked(before, after)
        fulls: list[Path] = [root / r for r in runs["probes"]]
        labels = [r["policy"] for r in g["rows"]]
        where = root / g.get("dir", "")
        row_cals = _row_calibrations(cal, fulls, labels, where, g["dcs"], g["gbps"])
        check = {**info.get("check", {}), **checked}
        if check["faults"]:
            out["flagged"].append({"dcs": g["dcs"], "gbps": g["gbps"], "faults": check["faults"]})
            print(
                f"{g['dcs']} DCs {fmt_gbps(g['gbps'])}: calibration flagged by the check: "
                + "; ".join(check["faults"]),
                file=sys.stderr,
            )
        out["calibrations"].append({**info, **cal.__dict__, "check": check})
        rows = []
        for r in g["rows"]:
            row_cal, factor = row_cals[r["policy"]]
            rep = replay_run(root / r["trace"], row_cal.constants(), skip=None)
            if rep.skip != r["measured_from"]:
                raise ValueError(
                    f"{r['trace']}: measured from {r['measured_from']}, now {rep.skip}"
                )
            pred = prediction(rep, r["median_seconds"], r["median_all_seconds"])
            meta = dict(read_trace(root / r["trace"] / "trace.npz").meta)
            split = measured_split(meta, rep.skip, int(r.get("cores", result.get("cores", 2))))
            rows.append({**r, **pred, **split, "drift_factor": factor})
        out["groups"].append({**g, "rows": rows})
    out["repredicted"] = {"commit": _commit(), "root": str(root)}
    return out


def measured_split(meta: dict[str, Any], skip: int, cores: int) -> dict[str, float]:
    """Where the measured steps' time went, from the trace (medians over steps ``skip``-):
    the ranks' CPU seconds summed over ``cores`` (the least wall time the machine needs
    to run them) and the longest total sleep in the link shaper of any rank; empty for
    a trace without per-rank counters."""
    cpu, sleep = meta.get("rank_cpu_seconds") or [], meta.get("rank_shaped_seconds") or []
    if not cpu or not sleep:
        return {}
    return {
        "cpu_over_cores_seconds": statistics.median(sum(c) / cores for c in cpu[skip:]),
        "longest_sleep_seconds": statistics.median(max(w) for w in sleep[skip:]),
        "cores": cores,
    }


def rep_meta(run: SpmdRun) -> dict[str, Any]:
    """The trace's meta: what the workers counted per step."""
    return dict(read_trace(run.trace_dir / "trace.npz").meta)


def _speed(gbps: float) -> str:
    return f"{gbps:g}gbps" if gbps >= 1 else f"{gbps * 1000:g}mbps"


def bench(args: argparse.Namespace) -> dict[str, Any]:
    lm = LMConfig(batch=args.batch)
    small = LMConfig(batch=max(args.batch // 4, 1))
    have = set(available_policies())
    out: dict[str, Any] = {"groups": [], "calibrations": [], "failed": [], "old_plane": old_plane()}
    root: Path = args.trace_dir
    with SharedCluster(max(args.dcs)) as cluster:
        print(f"cluster up in {cluster.start_seconds:.1f}s", flush=True)
        for dcs in args.dcs:
            free = topology(dcs, FREE_GBPS, 0.0, lm.num_experts)
            if args.warmup:  # not used: the cluster's first seconds are not the machine's
                run_spmd(settings(free, lm, "static", args), args.calib_steps)
            made = iter(range(1 << 16))  # the calibration runs' directories, in order

            def calibration_runs(
                free: Topology = free, dcs: int = dcs, made: Iterator[int] = made
            ) -> tuple[SpmdRun, SpmdRun, SpmdRun]:
                where = root / "calibration" / f"{dcs}dc-{next(made):02d}"
                return (
                    run_spmd(settings(free, lm, "static", args), args.calib_steps, where / "full"),
                    run_spmd(
                        settings(free, small, "static", args), args.calib_steps, where / "small"
                    ),
                    run_spmd(
                        settings(free, lm, "static", args, "replicated"),
                        args.calib_steps,
                        where / "replicated",
                    ),
                )

            def probe(where: Path, free: Topology = free) -> SpmdRun:
                return run_spmd(settings(free, lm, "static", args), args.calib_steps, where)

            labels_of = args.policies_3dc if dcs >= 3 and args.policies_3dc else args.policies
            labels = [p for p in labels_of if p.removesuffix("-bf16") in have]
            before: tuple[SpmdRun, SpmdRun, SpmdRun] | None = None
            for gbps in args.gbps:
                before = _checked_group(
                    out, args, dcs, gbps, lm, small, labels, before, calibration_runs, probe
                )
                _save(out, args)  # what is measured so far, should the run be cut short
    return out


def _calibrate_checked(
    before: Sequence[Run], after: Sequence[Run]
) -> tuple[Calibration, dict[str, Any]]:
    """A group's constants from its calibration runs before and after it (full batch,
    quarter batch, replicated layout each) and the check of those runs."""
    cal = calibrate([before[0], after[0]], [before[1], after[1]], replicated=[before[2], after[2]])
    return cal, check_calibration(before, after, cal)


def _checked_group(
    out: dict[str, Any],
    args: argparse.Namespace,
    dcs: int,
    gbps: float,
    lm: LMConfig,
    small: LMConfig,
    labels: list[str],
    before: tuple[SpmdRun, SpmdRun, SpmdRun] | None,
    calibration_runs: Callable[[], tuple[SpmdRun, SpmdRun, SpmdRun]],
    probe: Callable[[Path], SpmdRun],
) -> tuple[SpmdRun, SpmdRun, SpmdRun] | None:
    """One group, run whole again (its calibration before, rows, probes, calibration
    after) while its calibration fails the check (``spmdbench.check_calibration``), at
    most ``--calibration-attempts`` times in all. Every attempt is recorded: the first
    whose calibration passes as the group, each rejected one under ``rejected`` with its
    faults, rows and calibration; when none passes, the group goes under ``failed``
    (``calibration_failed``), not as rows. Returns the runs after the group (the next
    group's "before"), or None (the next group calibrates afresh)."""
    tries = max(args.calibration_attempts, 1) if args.calibration_check else 1
    for attempt in range(tries):
        try:  # a group that fails is recorded; the other groups still run
            before = before or calibration_runs()
            group, info, after = _group_and_calibration(
                args, dcs, gbps, lm, small, labels, before, calibration_runs, probe, attempt
            )
        except Exception as err:  # any failure of a group's runs
            out["failed"].append({"dcs": dcs, "gbps": gbps, "error": repr(err)[:500]})
            print(f"{dcs} DCs {fmt_gbps(gbps)}: the group failed: {err!r}", flush=True)
            return None
        faults = info["check"]["faults"]
        if not faults or not args.calibration_check:
            out["groups"].append(group)
            out["calibrations"].append(info)
            return after
        out.setdefault("rejected", []).append(
            {"dcs": dcs, "gbps": gbps, "attempt": attempt + 1, "faults": faults,
             "calibration": info, "group": group}
        )  # fmt: skip
        print(
            f"{dcs} DCs {fmt_gbps(gbps)}: attempt {attempt + 1} of {tries} rejected, its "
            f"calibration fails the check: {'; '.join(faults)}",
            flush=True,
        )
        _save(out, args)
        before = None  # the next attempt calibrates afresh, before and after
    out["failed"].append(
        {"dcs": dcs, "gbps": gbps, "calibration_failed": True,
         "error": f"its calibration failed the check in all {tries} attempts (under rejected)"}
    )  # fmt: skip
    print(f"{dcs} DCs {fmt_gbps(gbps)}: no attempt's calibration passed; no rows", flush=True)
    return None


def _group_and_calibration(
    args: argparse.Namespace,
    dcs: int,
    gbps: float,
    lm: LMConfig,
    small: LMConfig,
    labels: list[str],
    before: tuple[SpmdRun, SpmdRun, SpmdRun],
    calibration_runs: Callable[[], tuple[SpmdRun, SpmdRun, SpmdRun]],
    probe: Callable[[Path], SpmdRun],
    attempt: int = 0,
) -> tuple[dict[str, Any], dict[str, Any], tuple[SpmdRun, SpmdRun, SpmdRun]]:
    """One attempt at a group (DC count, bandwidth): its rows with a probe between each
    two, the calibration runs after it, its constants and their check. Returns ``(group,
    calibration, runs after it)`` (the last: the next group's "before"). The first
    attempt writes under ``--trace-dir``, attempt ``n`` > 1 under its ``attempt-<n>/``."""
    root: Path = args.trace_dir
    sub = f"attempt-{attempt + 1}" if attempt else ""
    runs, probes = _group_runs(dcs, gbps, lm, labels, args, probe, root / sub)
    after = calibration_runs()  # the next group's "before"
    cal, checked = _calibrate_checked(before, after)
    name = f"cal-{dcs}dc-{_speed(gbps)}.yaml"
    cal.write(root / sub / name)
    info = _calibration_info(dcs, gbps, cal, before, after, lm, small)
    info["check"] = {**checked, "attempt": attempt + 1}
    # the full-batch probes on either side of each row: [before, p1, ..., after]
    fulls = [before[0], *probes, after[0]]
    row_cals = _row_calibrations(cal, fulls, list(runs), root / sub, dcs, gbps)
    info["probe_medians"] = [f.median("seconds") for f in fulls]
    # every run's trace directory (relative to --trace-dir): a model change re-predicts
    # from them (--repredict) without running the runtime again
    info["runs"] = {
        "before": [_rel(r, root) for r in before],
        "after": [_rel(r, root) for r in after],
        "probes": [_rel(r, root) for r in fulls],
    }
    print(
        f"{dcs} DCs {fmt_gbps(gbps)} calibration (static, free links, before and "
        f"after the group): median step {cal.full_median:.3f}s at batch {lm.batch} "
        f"({info['full_medians'][0]:.3f}, {info['full_medians'][1]:.3f}), "
        f"{cal.small_median:.3f}s at {small.batch} -> a = "
        f"{cal.seconds_per_token * 1e6:.1f} us/token, c = "
        f"{cal.collective_seconds * 1e3:.2f} ms x {cal.collectives} collectives, "
        f"h = {cal.copy_seconds * 1e3:.2f} ms x {cal.copies:g} copies per rank "
        f"(replicated layout: {info['replicated_medians'][0]:.3f}, "
        f"{info['replicated_medians'][1]:.3f}, {cal.replicated_collectives} "
        f"collectives, {cal.replicated_copies:g} copies; load {info['load']:.1f}); "
        f"{root / sub / name}",
        flush=True,
    )
    faults = info["check"]["faults"]
    print(
        f"  calibration check: {'; '.join(faults) if faults else 'passes'} (attempt {attempt + 1})",
        flush=True,
    )
    return _group(dcs, gbps, runs, row_cals, name, sub), info, after


def _record_root(record: dict[str, Any]) -> Path:
    """A record's trace directory (a relative one: from the working directory if it is
    there, else from the repository)."""
    root = Path(record["args"]["trace_dir"])
    return root if root.is_absolute() or root.exists() else REPO / root


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Records of runs of different groups as one: their groups and calibrations in
    order, each run's record, wall seconds and load under ``parts``. A group in two
    records is an error (the table would have its rows twice), not a silent pick."""
    if len(results) == 1:
        return results[0]
    seen: dict[tuple[int, float], str] = {}
    for r in results:
        for g in r["groups"]:
            key, cmd = (g["dcs"], g["gbps"]), r.get("record", {}).get("command", "?")
            if key in seen:  # one table, one run per group: the caller picks which
                raise ValueError(
                    f"{g['dcs']} DCs {fmt_gbps(g['gbps'])} is in two records "
                    f"({seen[key]}; {cmd}): pass one of them"
                )
            seen[key] = cmd
    keys = ("record", "seconds", "load_avg", "stopped", "repredicted")
    parts = [
        {
            **{k: r[k] for k in keys if k in r},
            "groups": [[g["dcs"], g["gbps"]] for g in r["groups"]],
        }
        for r in results
    ]
    drop = ("stopped", "partial", "record", "repredicted")
    first = {k: v for k, v in results[0].items() if k not in drop}
    commits = {r["repredicted"]["commit"] if r.get("repredicted") else None for r in results}
    if len(commits) == 1 and None not in commits:  # every record, at one commit (roots: parts)
        first["repredicted"] = {"commit": commits.pop()}

    def order(g: dict[str, Any]) -> tuple[int, float]:  # DC count, then fastest link first
        return g["dcs"], -g["gbps"]

    return {
        **first,
        "groups": sorted((g for r in results for g in r["groups"]), key=order),
        "calibrations": sorted((c for r in results for c in r["calibrations"]), key=order),
        "failed": [f for r in results for f in r.get("failed", [])],
        "rejected": [a for r in results for a in r.get("rejected", [])],
        "flagged": [f for r in results for f in r.get("flagged", [])],
        "parts": parts,
        "seconds": sum(r["seconds"] for r in results),
        "load_avg": [results[0]["load_avg"][0], results[-1]["load_avg"][1]],
    }


def _rel(run: SpmdRun, root: Path) -> str:
    try:
        return str(run.trace_dir.relative_to(root))
    except ValueError:
        return str(run.trace_dir)


def _calibration_info(
    dcs: int,
    gbps: float,
    cal: Calibration,
    before: tuple[SpmdRun, SpmdRun, SpmdRun],
    after: tuple[SpmdRun, SpmdRun, SpmdRun],
    lm: LMConfig,
    small: LMConfig,
) -> dict[str, Any]:
    """The group's constants and each calibration run's own median (the drift over it)."""
    return {
        "dcs": dcs,
        "gbps": gbps,
        **cal.__dict__,
        "batch": lm.batch,
        "small_batch": small.batch,
        "full_medians": [before[0].median("seconds"), after[0].median("seconds")],
        "small_medians": [before[1].median("seconds"), after[1].median("seconds")],
        "replicated_medians": [before[2].median("seconds"), after[2].median("seconds")],
        "load": os.getloadavg()[0],
    }


def old_plane() -> list[dict[str, Any]]:
    """The removed Ray-rounds plane's last measured overhead (not re-run)."""
    rec = json.loads(OLD_PLANE.read_text())
    print(
        f"old plane (Ray rounds): removed from the code; its rows come from {OLD_PLANE.name} "
        f"(measured at {rec['commit'][:7]}, {rec['started_utc']} UTC), not re-run; reproduce: "
        f"{rec['command']}",
        flush=True,
    )
    return [{**o, "commit": rec["commit"]} for o in rec["old_plane"]]


def _save(out: dict[str, Any], args: argparse.Namespace) -> None:
    """What is measured so far, with what a record needs (flags, commit, start, wall,
    load): a run cut short is still a record ``--repredict`` and the results read."""
    if args.json is None:
        return
    t0, load0, started = args.begun
    flags = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    partial = {
        **out,
        "partial": True,
        "seconds": time.perf_counter() - t0,
        "load_avg": [list(load0), list(os.getloadavg())],
        "args": {k: v for k, v in flags.items() if k != "begun"},
        "record": {"command": args.command, "commit": _commit(), "started_utc": started},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(partial, indent=1))


def _group_runs(
    dcs: int,
    gbps: float,
    lm: LMConfig,
    labels: list[str],
    args: argparse.Namespace,
    probe: Callable[[Path], SpmdRun],
    root: Path,
) -> tuple[dict[str, SpmdRun], list[SpmdRun]]:
    """The group's rows, a full-batch calibration probe (static, free links) between each
    two, their traces under ``root``: ``(runs by label, probes)``."""
    topo = topology(dcs, gbps, args.latency_ms, lm.num_experts)
    runs: dict[str, SpmdRun] = {}
    probes: list[SpmdRun] = []
    for i, label in enumerate(labels):
        if i:
            probes.append(probe(root / "calibration" / f"{dcs}dc-{_speed(gbps)}-p{i}"))
        where = root / f"{dcs}dc-{_speed(gbps)}-{label}"
        runs[label] = run_spmd(settings(topo, lm, label, args), args.steps, where)
    return runs, probes


def _row_calibrations(
    cal: Calibration,
    fulls: Sequence[Run],
    labels: list[str],
    root: Path,
    dcs: int,
    gbps: float,
) -> dict[str, tuple[Calibration, float]]:
    """Each row's constants: the group's ``a`` and ``c`` (their split from the two batch
    sizes) times the drift factor of the full-batch probes just before and just after the
    row (``fulls[i]`` and ``fulls[i + 1]``, steps pooled: their median step less links)
    over the group's full-batch median; written as ``cal-<D>dc-<speed>-<policy>.yaml``."""
    base = residual([fulls[0], fulls[-1]])[1]
    out: dict[str, tuple[Calibration, float]] = {}
    for i, label in enumerate(labels):
        factor = residual([fulls[i], fulls[i + 1]])[1] / base if base > 0 else 1.0
        row_cal = cal.scaled(factor)
        row_cal.write(root / f"cal-{dcs}dc-{_speed(gbps)}-{label}.yaml")
        out[label] = (row_cal, factor)
    return out


def _group(
    dcs: int,
    gbps: float,
    runs: dict[str, SpmdRun],
    cals: dict[str, tuple[Calibration, float]],
    cal_name: str,
    sub: str = "",
) -> dict[str, Any]:
    """The group's rows (``sub``: the attempt's directory under --trace-dir, if any)."""
    pre = f"{sub}/" if sub else ""
    static = runs.get("static")
    rows = []
    for label, run in runs.items():
        cal, factor = cals[label]
        r = row(run, cal, static)
        r["policy"] = label
        r["drift_factor"] = factor
        r["calibration"] = f"{pre}cal-{dcs}dc-{_speed(gbps)}-{label}.yaml"
        r["trace"] = f"{pre}{dcs}dc-{_speed(gbps)}-{label}"  # relative to --trace-dir
        rows.append(r)
        print(f"  {dcs} DCs {fmt_gbps(gbps):>11} {line(r)}", flush=True)
    return {
        "dcs": dcs, "gbps": gbps, "rows": rows, "load": os.getloadavg()[0],
        "calibration": pre + cal_name, "dir": sub,
    }  # fmt: skip


def _commit() -> str:
    """The checkout's commit (``?`` outside git)."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dcs", default="2,3", help="DC counts (default 2,3)")
    p.add_argument(
        "--gbps",
        default="1,0.02,0.1",
        help="inter-DC Gbit/s (default 1,0.02,0.1; the old plane runs at the first)",
    )
    p.add_argument("--latency-ms", type=float, default=LATENCY_MS, help="inter-DC latency")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--steps", type=int, default=16, help="steps per row (the first not measured)")
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one unused full-batch static run on free links before each DC count's first "
        "calibration (default on: the first run on a fresh cluster measured steps 2-3x "
        "slower at unchanged CPU, something outside the ranks taking the cores)",
    )
    p.add_argument("--every", type=int, default=3, help="steps between plans")
    p.add_argument(
        "--calib-steps", type=int, default=16, help="steps of each calibration run and probe"
    )
    p.add_argument("--batch", type=int, default=LMConfig().batch, help="sequences per rank")
    p.add_argument("--corpus-bytes", type=int, default=300_000)
    p.add_argument(
        "--calibration-check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="re-run a group whose calibration fails spmdbench.check_calibration (default "
        "on; off: the check is recorded, the first attempt kept whatever it says)",
    )
    p.add_argument(
        "--calibration-attempts",
        type=int,
        default=3,
        help="attempts at a group in all while its calibration fails the check (default 3)",
    )
    p.add_argument(
        "--policies-3dc", default="", help="policies at 3 DCs and more (default: --policies)"
    )
    p.add_argument(
        "--trace-dir",
        type=Path,
        default=REPO / "out" / "bench-runtime",
        help="each row's trace.npz and plans.npz (<D>dc-<speed>-<policy>/) and its group's "
        "cal-<D>dc-<speed>.yaml",
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 2 DCs, 20 Mbit/s, static + hybrid"
    )
    p.add_argument("--json", type=Path, help="write every measurement here")
    p.add_argument(
        "--repredict",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="no run: predict recorded runs (their --json) again from the traces they wrote "
        "under their --trace-dir (this flag's --trace-dir when given, one record), with the "
        "current model; several records (runs of different groups) make one table; "
        "writes --json",
    )
    args = p.parse_args(argv)
    if args.repredict:
        given = "--trace-dir" in (sys.argv[1:] if argv is None else argv)
        if given and len(args.repredict) > 1:
            p.error("--trace-dir with one --repredict record only (each names its own)")
        records = [json.loads(path.read_text()) for path in args.repredict]
        try:
            merge(records)  # a group in two records: refused before any replay
        except ValueError as e:
            p.error(str(e))
        result = merge(
            [repredict(rec, args.trace_dir if given else _record_root(rec)) for rec in records]
        )
        result["markdown"] = markdown(result)
        print(result["markdown"])
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))
        return 0
    args.dcs = [int(x) for x in args.dcs.split(",")]
    args.gbps = [float(x) for x in args.gbps.split(",")]
    args.policies = [x for x in args.policies.split(",") if x]
    args.policies_3dc = [x for x in args.policies_3dc.split(",") if x]
    if args.quick:
        args.dcs, args.gbps, args.policies = [2], [0.02], ["static", "hybrid"]
        args.steps, args.calib_steps, args.batch, args.warmup = 4, 3, 4, False
        args.calibration_check = False  # a smoke run's tiny batch calibrates nothing
    if args.steps < 3 or args.calib_steps < 3:
        p.error("--steps and --calib-steps must be >= 3 (the first step is not measured)")

    args.command = "python bench/bench_runtime.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    args.begun = (
        time.perf_counter(),
        os.getloadavg(),
        time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    )

    def record(result: dict[str, Any], started: str) -> None:
        # docs/results.md's runtime table reads it (bench/results_runtime.py)
        result["record"] = {"command": args.command, "commit": _commit(), "started_utc": started}
        result["args"].pop("begun", None)

    return run_bench(args, bench, markdown, record)


if __name__ == "__main__":
    raise SystemExit(main())
