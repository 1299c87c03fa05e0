"""``expertmesh sim``: run policies over a trace on a topology with the cost model.

``expertmesh sim --topology T.yaml --trace X.npz --policies static,hybrid --out DIR``
writes ``DIR/steps.csv`` (one row per policy and step), ``DIR/summary.md`` and
``DIR/step_times.png``. Without ``--topology`` a uniform topology is generated
(``--dcs 1000 --ranks-per-dc 8 ...``); without ``--trace`` a seeded synthetic trace
is generated step by step.

``expertmesh sim sweep --config sweep.yaml --out DIR`` runs the bandwidth and
DC-count sweeps and writes ``DIR/sweep.csv``, ``DIR/sweep.md`` and the speedup
plots.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from expertmesh.cli.main import UsageError
from expertmesh.formats import read_plan, read_topology, read_trace, read_yaml
from expertmesh.planner.costmodel import CostSettings
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.topology import Topology
from expertmesh.planner.trace import generate_trace
from expertmesh.sim.engine import LoadSource, SimResult, dense_source, simulate
from expertmesh.sim.groups import auto_group_dcs, simulate_groups
from expertmesh.sim.replay import Calibration, RuntimeMeta, replay
from expertmesh.sim.report import (
    cpu_breakdown,
    plot_speedup,
    plot_step_times,
    summary_rows,
    summary_table,
    write_steps_csv,
)
from expertmesh.sim.sweep import (
    DEFAULT_POLICIES,
    SweepPoint,
    TraceSpec,
    load_sweep_config,
    points,
    run_sweep,
)

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate policies over a trace with the cost model (and sweeps)",
        description="Run placement policies over a trace on a topology and model every step "
        "with the stream-based cost model (docs/cost-model.md). Writes a per-step CSV, a "
        "markdown summary and a plot of step time per policy. `expertmesh sim sweep` runs "
        "the bandwidth and DC-count sweeps.",
    )
    _run_args(p)
    p.set_defaults(func=run)
    sp = p.add_subparsers(dest="sim_command", metavar="{sweep,replay}")
    s = sp.add_parser(
        "sweep",
        help="speedup over static against inter-DC bandwidth and number of DCs",
        description="Run the sweeps of a config (see expertmesh.sim.sweep for the keys).",
    )
    s.add_argument("--config", type=Path, help="sweep YAML (default: the built-in sweep)")
    s.add_argument("--out", type=Path, required=True, help="output directory")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=run_sweep_cmd)
    r = sp.add_parser(
        "replay",
        help="predict a runtime run's step times from the trace and plan it wrote",
        description="Model every step of an SPMD training run from the trace.npz and "
        "plans.npz the runtime wrote (expertmesh.runtime.trace) with the calibrated constants "
        "`make bench-runtime` writes (YAML: seconds_per_token, collective_seconds, ranks); "
        "print the predicted and measured median step (expertmesh.sim.replay).",
    )
    r.add_argument("--trace", type=Path, required=True, help="trace .npz the runtime wrote")
    r.add_argument("--plan", type=Path, required=True, help="plans.npz of the steps it ran")
    r.add_argument("--calibration", type=Path, required=True, help="YAML of the constants")
    r.add_argument("--out", type=Path, help="write replay.csv (step, predicted, measured) here")
    r.set_defaults(func=run_replay_cmd)


def _run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("topology (a file, or generated)")
    g.add_argument("--topology", type=Path, help="topology YAML")
    g.add_argument("--dcs", type=int, help="generate: number of DCs")
    g.add_argument("--ranks-per-dc", type=int, default=8, help="generate: ranks per DC (8)")
    g.add_argument("--nodes-per-dc", type=int, default=1, help="generate: nodes per DC (1)")
    g.add_argument("--masters", type=int, default=4, help="generate: master slots per rank (4)")
    g.add_argument("--spare", type=int, default=2, help="generate: spare slots per rank (2)")
    g.add_argument(
        "--ep-dcs",
        type=int,
        help="generate: DCs per data-parallel EP group (default: the fewest DCs whose master "
        "slots hold every expert, when that divides --dcs; = --dcs: one group)",
    )
    g.add_argument("--inter-dc-gbps", type=float, help="inter-DC bandwidth (overrides the file)")
    g.add_argument("--inter-dc-latency-ms", type=float, help="inter-DC latency (default 20)")
    t = p.add_argument_group("trace (a file, or generated)")
    t.add_argument("--trace", type=Path, help="trace .npz with load [T, L, R, E]")
    t.add_argument("--steps", type=int, default=20, help="generate: steps (20)")
    t.add_argument("--layers", type=int, default=1, help="generate: MoE layers (1)")
    t.add_argument("--tokens-per-rank", type=int, default=8192, help="generate: tokens (8192)")
    t.add_argument(
        "--imbalance",
        type=float,
        default=2.0,
        help="generate: static-EP max/mean on one rank per expert (2.0; the skew)",
    )
    t.add_argument("--drift", type=float, default=0.02, help="generate: hot-set drift (0.02)")
    t.add_argument("--seed", type=int, default=0, help="generate: seed (0)")
    m = p.add_argument_group("model and cost model")
    m.add_argument("--experts", type=int, help="experts per layer (default: the trace's, or 256)")
    m.add_argument("--top-k", type=int, help="experts per token (default: trace meta, or 8)")
    m.add_argument("--hidden", type=int, help="model width (default: trace meta, or 7168)")
    m.add_argument("--ffn-hidden", type=int, default=2048, help="expert FFN width (2048)")
    m.add_argument("--forward-only", action="store_true", help="no backward pass (inference)")
    m.add_argument("--flops-per-second", type=float, help="expert FLOP/s per rank (4e14)")
    m.add_argument("--pipeline-chunks", type=int, help="overlap chunks (1: none)")
    m.add_argument("--microbatches-per-update", type=int, help="steps per optimizer update (1)")
    m.add_argument(
        "--flat-dispatch",
        action="store_true",
        help="flat all-to-all: every top-k assignment crosses a DC pair on its own (default: "
        "hierarchical, a token crosses once per DC)",
    )
    p.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="comma-separated policies (default: " + ",".join(DEFAULT_POLICIES) + ")",
    )
    p.add_argument("--policy-settings", type=Path, help="YAML: {policy: {setting: value}}")
    p.add_argument("--out", type=Path, help="output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---- inputs ----


def _read_yaml(path: Path) -> Any:
    return read_yaml(path, "YAML")  # hostile-safe: size, UTF-8, alias bombs, depth


def _topology(args: argparse.Namespace) -> Topology:
    if args.topology is not None and args.dcs is not None:
        raise UsageError("give --topology or --dcs, not both")
    if args.topology is not None:
        topo = read_topology(args.topology)
    elif args.dcs is not None:
        topo = Topology.generate(
            args.dcs,
            args.ranks_per_dc,
            nodes_per_dc=args.nodes_per_dc,
            masters=args.masters,
            spare=args.spare,
        )
    else:
        raise UsageError("give --topology FILE or --dcs N (with --ranks-per-dc ...)")
    if args.inter_dc_gbps is not None or args.inter_dc_latency_ms is not None:
        if args.inter_dc_gbps is not None and args.inter_dc_gbps <= 0:
            raise UsageError("--inter-dc-gbps must be > 0")
        gbps = topo.inter_dc.gbps if args.inter_dc_gbps is None else args.inter_dc_gbps
        topo = topo.with_inter_dc(gbps, args.inter_dc_latency_ms)
    return topo


def _model(args: argparse.Namespace, layers: int, experts: int, meta: dict[str, Any]) -> ModelSpec:
    if args.experts is not None and args.experts != experts:
        raise UsageError(f"--experts {args.experts} but the trace has {experts} experts")
    return _validated(
        ModelSpec,
        {
            "num_layers": layers,
            "num_experts": experts,
            "top_k": args.top_k or int(meta.get("top_k", 8)),
            "hidden": args.hidden or int(meta.get("hidden", 7168)),
            "ffn_hidden": args.ffn_hidden,
            "training": not args.forward_only,
        },
    )


def _validated(cls: Any, values: dict[str, Any]) -> Any:
    """``cls.model_validate(values)`` with the first error as a one-line usage error."""
    try:
        return cls.model_validate(values)
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        raise UsageError(f"{where.replace('_', '-')}: {e['msg']}") from None


def _cost(args: argparse.Namespace) -> CostSettings:
    over: dict[str, Any] = {}
    for key in ("flops_per_second", "pipeline_chunks", "microbatches_per_update"):
        if getattr(args, key) is not None:
            over[key] = getattr(args, key)
    if args.flat_dispatch:
        over["hierarchical"] = False
    cost: CostSettings = _validated(CostSettings, over)
    return cost


def _policies(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError("--policies is empty")
    if len(set(names)) != len(names):
        raise UsageError("--policies names a policy twice")
    return names


def _progress(total: int, disable: bool, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, disable=disable, desc=desc, unit="step", leave=False, file=sys.stderr)


# ---- expertmesh sim ----


def run(args: argparse.Namespace) -> int:
    if args.out is None:
        raise UsageError("--out DIR is required")
    topo = _topology(args)
    policies = _policies(args.policies)
    settings: dict[str, dict[str, Any]] = {}
    if args.policy_settings is not None:
        raw = _read_yaml(args.policy_settings) or {}
        if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
            raise UsageError(f"{args.policy_settings}: expected {{policy: {{setting: value}}}}")
        settings = raw
    groups = _groups(args, topo)
    if groups > 1:
        return _run_groups(args, topo, groups, policies, settings)
    source: LoadSource
    trace_cpu = 0.0  # CPU seconds generating the trace
    if args.trace is not None:
        trace = read_trace(args.trace)
        load, meta = trace.load, trace.meta
        if load.shape[2] != topo.num_ranks:
            raise UsageError(f"trace has {load.shape[2]} ranks, the topology {topo.num_ranks}")
        model = _model(args, load.shape[1], load.shape[3], meta)
        source = dense_source(load)
    else:
        model = _model(args, args.layers, args.experts or 256, {})
        spec = _trace_spec(args)
        try:
            settings_ = spec.settings(topo.num_ranks, model)
        except ValidationError as err:
            raise UsageError(f"trace: {err.errors()[0]['msg']}") from None
        t0 = time.process_time()
        source = dense_source(generate_trace(settings_).load)
        trace_cpu = time.process_time() - t0
    return _simulate_and_write(
        args, topo, model, source, policies=policies, settings=settings, trace_cpu=trace_cpu
    )


def _groups(args: argparse.Namespace, topo: Topology) -> int:
    """How many data-parallel EP groups the generated world runs (1: plan it whole)."""
    if args.dcs is None or args.trace is not None:
        if args.ep_dcs is not None:
            raise UsageError("--ep-dcs needs a generated topology and trace (--dcs, no --trace)")
        return 1
    experts = args.experts or 256
    if args.ep_dcs is None:
        try:
            per = auto_group_dcs(args.dcs, args.ranks_per_dc, experts, args.masters)
        except ValueError as err:
            raise UsageError(str(err)) from None
    else:
        per = args.ep_dcs
        if per < 1 or args.dcs % per:
            raise UsageError(f"--ep-dcs {per} must be >= 1 and divide --dcs {args.dcs}")
    return args.dcs // per


def _run_groups(
    args: argparse.Namespace,
    topo: Topology,
    groups: int,
    policies: list[str],
    settings: dict[str, dict[str, Any]],
) -> int:
    """``groups`` EP groups of ``topo``'s DCs, one generated trace each."""
    per = topo.num_dcs // groups
    group = Topology.generate(
        per, args.ranks_per_dc, nodes_per_dc=args.nodes_per_dc, masters=args.masters,
        spare=args.spare, inter_dc_gbps=topo.inter_dc.gbps,
        inter_dc_latency_ms=topo.inter_dc.latency_ms,
    )  # fmt: skip
    model = _model(args, args.layers, args.experts or 256, {})
    spec = _trace_spec(args)

    trace_cpu = [0.0]  # CPU seconds generating the groups' traces

    def make(g: int) -> LoadSource:
        t0 = time.process_time()
        s = spec.model_copy(update={"seed": spec.seed + g}).settings(group.num_ranks, model)
        out = dense_source(generate_trace(s).load)
        trace_cpu[0] += time.process_time() - t0
        return out

    try:
        first: LoadSource | None = make(0)  # bad trace settings fail before anything runs
    except ValidationError as err:
        raise UsageError(f"trace: {err.errors()[0]['msg']}") from None

    def trace(g: int) -> LoadSource:
        nonlocal first
        if g == 0 and first is not None:
            out, first = first, None  # generated once, held only until group 0 runs
            return out
        return make(g)

    cost = _cost(args)
    args.out.mkdir(parents=True, exist_ok=True)
    bar = _progress(args.steps * len(policies) * groups, args.no_progress, "sim")
    try:
        result = simulate_groups(
            group, groups, trace, model, policies,
            policy_settings=settings, cost=cost, progress=bar.update,
        )  # fmt: skip
    finally:
        bar.close()
    _write_run(result, args.out, topo, model, trace_cpu[0])
    print(summary_table(result))
    print(
        f"wrote {args.out}/steps.csv, summary.md, step_times.png, cpu.json "
        f"({result.wall_seconds:.1f} s)"
    )
    return 0


def _trace_spec(args: argparse.Namespace) -> TraceSpec:
    spec: TraceSpec = _validated(
        TraceSpec,
        {
            "steps": args.steps,
            "tokens_per_rank": args.tokens_per_rank,
            "imbalance": args.imbalance,
            "drift": args.drift,
            "seed": args.seed,
        },
    )
    return spec


def _simulate_and_write(
    args: argparse.Namespace,
    topo: Topology,
    model: ModelSpec,
    source: LoadSource,
    *,
    policies: list[str],
    settings: dict[str, dict[str, Any]],
    trace_cpu: float = 0.0,
) -> int:
    cost = _cost(args)
    args.out.mkdir(parents=True, exist_ok=True)
    bar = _progress(source.num_steps * len(policies), args.no_progress, "sim")
    try:
        result = simulate(
            source, topo, model, policies, policy_settings=settings, cost=cost, progress=bar.update
        )
    finally:
        bar.close()
    _write_run(result, args.out, topo, model, trace_cpu)
    print(summary_table(result))
    print(
        f"wrote {args.out}/steps.csv, summary.md, step_times.png, cpu.json "
        f"({result.wall_seconds:.1f} s)"
    )
    return 0


def _write_run(
    result: SimResult, out: Path, topo: Topology, model: ModelSpec, trace_cpu: float
) -> None:
    write_steps_csv(result, out / "steps.csv")
    (out / "cpu.json").write_text(json.dumps(cpu_breakdown(result, trace_cpu), indent=1) + "\n")
    title = (
        f"{topo.num_dcs} DCs x {topo.num_ranks // topo.num_dcs} ranks, {model.num_experts} experts"
    )
    about = _describe(topo, model)
    if result.num_groups > 1:
        g = result.num_groups
        about += (
            f" {g} data-parallel EP groups of {topo.num_dcs // g} DCs (each holds every expert;"
            f" static EP fills every rank's master slots); the cross-group gradient all-reduce"
            f" adds {result.dp_seconds:.4g} s to every step of every policy."
        )
    (out / "summary.md").write_text(
        f"# expertmesh sim: {title}\n\n{about}\n\n{summary_table(result)}\n"
    )
    plot_step_times(result, out / "step_times.png", title)


def _describe(topo: Topology, model: ModelSpec) -> str:
    return (
        f"Inter-DC {topo.inter_dc.gbps:g} Gbit/s, {topo.inter_dc.latency_ms:g} ms; "
        f"{topo.masters_per_rank}+{topo.spare_per_rank} slots per rank; top-{model.top_k}, "
        f"hidden {model.hidden}, FFN {model.ffn_hidden}, "
        f"{'training' if model.training else 'forward only'}."
    )


# ---- expertmesh sim replay ----


def run_replay_cmd(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace)
    plan = read_plan(args.plan)
    cal: Calibration = _validated(Calibration, _read_yaml(args.calibration) or {})
    meta: RuntimeMeta = _validated(RuntimeMeta, trace.meta)
    if plan.master is None:
        raise UsageError(f"{args.plan}: the plan has no 'master' array (write it with the plan)")
    mig = plan.meta.get("migration_collectives", {})
    try:
        migration = {int(v): (int(n), int(c)) for v, (n, c) in dict(mig).items()}
    except (TypeError, ValueError):
        raise UsageError(
            f"{args.plan}: meta 'migration_collectives' must map versions to [collectives, "
            "crossing]"
        ) from None
    try:
        res = replay(
            trace.load, meta, plan.phy2log, plan.master, plan.route,
            migration=migration, calibration=cal,
        )  # fmt: skip
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "replay.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(("step", "predicted_seconds", "measured_seconds", *res.parts))
            for t, p in enumerate(res.predicted):
                m = res.measured[t] if res.measured.size else ""
                w.writerow(
                    (t, f"{p:.6g}", m if m == "" else f"{m:.6g}",
                     *(f"{v[t]:.6g}" for v in res.parts.values()))
                )  # fmt: skip
    line = f"{meta.policy}: predicted median step {res.predicted_median:.4g} s"
    if res.measured.size:
        line += f", measured {res.measured_median:.4g} s, error {res.error:+.1%}"
    print(line + f" (medians of steps {res.skip}-{res.predicted.size - 1})")
    return 0


# ---- expertmesh sim sweep ----


def run_sweep_cmd(args: argparse.Namespace) -> int:
    config = load_sweep_config(_read_yaml(args.config) if args.config is not None else {})
    args.out.mkdir(parents=True, exist_ok=True)
    total = sum(p.steps * p.groups for p in points(config)) * len(config.policies)
    bar = _progress(total, args.no_progress, "sweep")
    t0 = time.perf_counter()
    try:
        pts = run_sweep(config, progress=bar.update)
    finally:
        bar.close()
    write_sweep(pts, args.out, config.policies)
    print((args.out / "sweep.md").read_text())
    print(f"wrote {args.out}/sweep.csv, sweep.md and plots ({time.perf_counter() - t0:.0f} s)")
    return 0


SWEEP_COLUMNS = (
    "kind", "label", "x", "groups", "microbatches_per_update", "tokens_per_rank", "policy", "mean_seconds", "median_seconds", "speedup", "mean_imbalance",
    "cross_dc_token_bytes", "cross_dc_weight_bytes", "migration_bytes", "solve_seconds",
    "skipped",
)  # fmt: skip


def write_sweep(pts: list[SweepPoint], out: Path, policies: list[str]) -> None:
    """``sweep.csv`` (one row per point and policy), ``sweep.md`` and the speedup plots."""
    with (out / "sweep.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(SWEEP_COLUMNS)
        for p in pts:
            for r in summary_rows(p.result):
                head = [p.kind, p.label, f"{p.x:g}", p.groups, p.microbatches, p.tokens_per_rank]
                w.writerow(head + [_cell(r.get(c, "")) for c in SWEEP_COLUMNS[6:]])
    md = ["# expertmesh sim sweep", ""]
    for kind, xlabel, fname in (
        ("bandwidth", "inter-DC bandwidth (Gbit/s)", "speedup_vs_bandwidth.png"),
        ("dcs", "number of DCs", "speedup_vs_dcs.png"),
        ("scale", "inter-DC bandwidth at the largest DC count (Gbit/s)", "speedup_at_scale.png"),
    ):
        sel = [p for p in pts if p.kind == kind]
        if not sel:
            continue
        xs = [p.x for p in sel]
        ran = [n for n in policies if any(p.result.run(n) for p in sel)]
        speedups = {n: [p.result.speedup(n) for p in sel] for n in ran}
        plot_speedup(xs, speedups, out / fname, xlabel=xlabel, title=f"speedup vs {kind}")
        md += [f"## Speedup over static vs {xlabel}", "", f"![]({fname})", ""]
        md += ["| " + xlabel + " | " + " | ".join(ran) + " |", "|---:|" + "---:|" * len(ran)]
        for p in sel:
            cells = [f"{p.result.speedup(n):.2f}x" for n in ran]
            md.append(f"| {p.x:g} | " + " | ".join(cells) + " |")
        skipped = {r.name: r.skipped for p in sel for r in p.result.runs if r.skipped}
        md += [""] + [f"- `{n}` skipped: {why}" for n, why in skipped.items()] + [""]
    (out / "sweep.md").write_text("\n".join(md))


def _cell(v: object) -> object:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return v
