"""``expertmesh plan``: plan a trace with a policy; inspect and compare plan files."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError
from tqdm import tqdm

from expertmesh.cli.engines import add_export_parser
from expertmesh.cli.main import UsageError
from expertmesh.cli.output import console, fmt_bytes, table
from expertmesh.formats import (
    PlanFile,
    Trace,
    read_plan,
    read_topology,
    read_trace,
    validate_plan,
    write_plan,
)
from expertmesh.planner import ModelSpec, Topology, available_policies, make_policy, plan_trace
from expertmesh.planner.summary import PlanSummary, summarize_plan

__all__ = ["add_parser", "parse_settings"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="plan a trace with a policy; inspect and compare plans",
        description="Plan every step and layer of a trace with one policy and write the plan "
        "(.npz, README: Interchange formats). Actions: `plan inspect PLAN --trace T` prints "
        "per-step figures, `plan compare --trace T PLAN...` one row per plan, `plan policies` "
        "the policies and their settings, `plan export PLAN --format ENGINE` an engine's "
        "placement file.",
        usage="expertmesh plan --trace T.npz --topology TOPO.yaml --policy P --out PLAN.npz "
        "[options]\n       expertmesh plan {inspect,compare,policies,export} ...",
    )
    p.add_argument("--trace", type=Path, help="trace file (.npz)")
    p.add_argument("--topology", type=Path, help="topology YAML")
    p.add_argument("--policy", help="policy name (see `expertmesh plan policies`)")
    p.add_argument("--out", type=Path, help="plan file to write (.npz)")
    p.add_argument("--spare-slots", type=int, help="override the topology's spare slots per rank")
    p.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a policy setting (repeatable; VALUE parsed as JSON, else a string; nested keys "
        "with dots, e.g. cost.pipeline_chunks=4)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no summary table")
    _model_flags(p)
    p.set_defaults(func=run_plan)

    actions = p.add_subparsers(dest="plan_command", metavar="ACTION")
    i = actions.add_parser("inspect", help="per-step figures of a plan over its trace")
    i.add_argument("plan", type=Path, help="plan file (.npz)")
    i.add_argument("--trace", type=Path, help="the trace the plan was made for (required)")
    i.add_argument("--topology", type=Path, help="topology YAML (default: the plan's own)")
    i.add_argument("--per-layer", action="store_true", help="one row per step and layer")
    i.set_defaults(func=run_inspect)

    c = actions.add_parser("compare", help="one summary row per plan of the same trace")
    c.add_argument("plans", type=Path, nargs="+", help="plan files (.npz)")
    c.add_argument("--trace", type=Path, help="the trace the plans were made for (required)")
    c.add_argument("--topology", type=Path, help="topology YAML (default: each plan's own)")
    c.set_defaults(func=run_compare)

    pol = actions.add_parser("policies", help="list the policies and their settings")
    pol.add_argument("--names", action="store_true", help="names only, one per line")
    pol.set_defaults(func=run_policies)

    add_export_parser(actions)


def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (default: the trace's meta, else ModelSpec's defaults)")
    g.add_argument("--top-k", type=int, help="experts per token")
    g.add_argument("--hidden", type=int, help="model width")
    g.add_argument("--ffn-hidden", type=int, help="expert FFN width")
    g.add_argument("--forward-only", action="store_true", help="inference: no backward pass")


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------


def parse_settings(items: list[str]) -> dict[str, Any]:
    """``["a=1", "cost.x=true", "mode=global"]`` -> ``{"a": 1, "cost": {"x": True}, ...}``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UsageError(f"--set {key}: {part} is set to a value, not a group")
            node = child
        if leaf in node:
            raise UsageError(f"--set {key} given twice")
        node[leaf] = value
    return out


def _model(args: argparse.Namespace, trace: Trace) -> ModelSpec:
    meta = trace.meta
    _, num_layers, _, num_experts = trace.load.shape
    fields: dict[str, Any] = {"num_layers": num_layers, "num_experts": num_experts}
    for key in ("top_k", "hidden", "ffn_hidden"):
        flag = getattr(args, key, None)
        if flag is not None:
            fields[key] = flag
        elif key in meta:
            fields[key] = meta[key]
    if getattr(args, "forward_only", False):
        fields["training"] = False
    return _model_from(fields)


def _model_from(fields: dict[str, Any]) -> ModelSpec:
    try:
        return ModelSpec(**fields)
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(x) for x in e["loc"])
        raise UsageError(f"model {where}: {e['msg']}") from None


def _check_fit(trace: Trace, trace_path: Path, topo: Topology, topo_path: Path | str) -> None:
    _, _, num_ranks, num_experts = trace.load.shape
    if num_ranks != topo.num_ranks:
        raise UsageError(f"{trace_path} has {num_ranks} ranks but {topo_path} has {topo.num_ranks}")
    if num_experts > topo.num_ranks * topo.masters_per_rank:
        raise UsageError(
            f"{trace_path} has {num_experts} experts, which do not fit the master slots of "
            f"{topo_path}: {topo.num_ranks} ranks x {topo.masters_per_rank} = "
            f"{topo.num_ranks * topo.masters_per_rank}"
        )


def _need(args: argparse.Namespace, action: str, *names: str) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n, None) is None]
    if missing:
        raise UsageError(f"{action} needs {', '.join(missing)}")


# ---------------------------------------------------------------------------
# expertmesh plan
# ---------------------------------------------------------------------------


def run_plan(args: argparse.Namespace) -> int:
    _need(args, "plan", "trace", "topology", "policy", "out")
    settings = parse_settings(args.settings)
    policy = make_policy(args.policy, settings)  # unknown policy / bad settings: ValueError
    trace = read_trace(args.trace)
    topo = read_topology(args.topology)
    if args.spare_slots is not None:
        if args.spare_slots < 0:
            raise UsageError(f"--spare-slots must be >= 0, got {args.spare_slots}")
        topo = topo.with_spare(args.spare_slots)
    _check_fit(trace, args.trace, topo, args.topology)
    model = _model(args, trace)
    num_steps = trace.load.shape[0]
    t0 = time.perf_counter()
    with tqdm(
        total=num_steps, desc=f"plan {policy.name}", unit="step", disable=None, file=sys.stderr,
        leave=False,
    ) as bar:  # fmt: skip
        plan = plan_trace(trace.load, topo, model, policy, progress=lambda _: bar.update(1))
    seconds = time.perf_counter() - t0
    arrays = plan.to_arrays()
    meta = {
        "format": "expertmesh-plan/1",
        "policy": policy.name,
        "settings": policy.settings.model_dump(mode="json"),
        "model": model.model_dump(mode="json"),
        "topology": topo.to_dict(),
        "trace": {"file": str(args.trace), "shape": list(trace.load.shape)},
    }
    if isinstance(trace.meta.get("engine"), dict):  # an imported trace: its engine's layers
        meta["engine"] = trace.meta["engine"]
    write_plan(args.out, arrays, meta)
    if args.quiet:
        return 0
    summary = summarize_plan(arrays, trace.load, topo, model)
    out = _summary_table(f"plan written to {args.out} ({seconds:.1f} s)", speedup=False)
    _summary_row(out, args.out, policy.name, meta["settings"], s=summary, base_s=None)
    console().print(out)
    return 0


# ---------------------------------------------------------------------------
# inspect / compare
# ---------------------------------------------------------------------------


def _plan_context(
    plan: PlanFile, plan_path: Path, trace: Trace, topo_path: Path | None
) -> tuple[Topology, ModelSpec]:
    if topo_path is not None:
        topo = read_topology(topo_path)
        spare = plan.shape[3] - topo.masters_per_rank
        if spare >= 0 and spare != topo.spare_per_rank:
            topo = topo.with_spare(spare)
    elif isinstance(plan.meta.get("topology"), dict):
        try:
            topo = Topology.from_dict(plan.meta["topology"])
        except ValueError as err:
            raise ValueError(f"{plan_path}: meta {err}") from None
    else:
        raise UsageError(f"{plan_path} does not record its topology; pass --topology")
    if topo.num_ranks != plan.shape[2]:
        raise UsageError(
            f"{plan_path} has {plan.shape[2]} ranks, its topology has {topo.num_ranks}"
        )
    model_meta = plan.meta.get("model")
    if isinstance(model_meta, dict):
        model = _model_from(dict(model_meta))
        if model.num_experts != trace.load.shape[3]:
            raise UsageError(
                f"{plan_path} was made for {model.num_experts} experts, the trace has "
                f"{trace.load.shape[3]}"
            )
    else:
        model = _model(argparse.Namespace(), trace)
    return topo, model


def _load_plan(
    path: Path, trace: Trace, trace_path: Path, topo_path: Path | None
) -> tuple[PlanFile, PlanSummary]:
    plan = read_plan(path)
    validate_plan(plan, trace.load, str(path), str(trace_path))
    topo, model = _plan_context(plan, path, trace, topo_path)
    return plan, summarize_plan(plan.arrays(), trace.load, topo, model)


def run_inspect(args: argparse.Namespace) -> int:
    _need(args, "plan inspect", "trace")
    trace = read_trace(args.trace)
    plan, s = _load_plan(args.plan, trace, args.trace, args.topology)
    cols = ["step", "layer"] if args.per_layer else ["step"]
    cols += ["static", "max/mean", "worst layer", "straggler", "copies", "migrated",
             "x-DC tokens", "x-DC weights", "step ms", "solve ms"]  # fmt: skip
    if args.per_layer:
        cols.remove("worst layer")
    out = table(f"{args.plan}: policy {plan.policy}{_settings_text(plan.meta)}", cols)
    num_steps, num_layers = s.imbalance.shape
    for t in range(num_steps):
        if args.per_layer:
            for layer in range(num_layers):
                ix = (t, slice(layer, layer + 1))
                out.add_row(str(t), str(layer), *_cells(s, ix, per_layer=True))
        else:
            out.add_row(str(t), *_cells(s, (t, slice(None)), per_layer=False))
    console().print(out)
    return 0


def _cells(s: PlanSummary, ix: tuple[int, slice], per_layer: bool) -> list[str]:
    imb = s.imbalance[ix]
    row = [f"{s.static_imbalance[ix].mean():.3f}", f"{imb.mean():.3f}"]
    if not per_layer:
        row.append(f"{imb.max():.3f}")
    row += [
        f"{s.straggler[ix].sum():,.0f}",
        f"{int(s.copies[ix].sum()):,}",
        fmt_bytes(float(s.migrated_bytes[ix].sum())),
        fmt_bytes(float(s.cross_dc_token_bytes[ix].sum())),
        fmt_bytes(float(s.cross_dc_weight_bytes[ix].sum())),
        f"{1e3 * s.step_seconds[ix].sum():.3f}",
        f"{1e3 * s.solve_seconds[ix].sum():.3f}",
    ]
    return row


def run_compare(args: argparse.Namespace) -> int:
    _need(args, "plan compare", "trace")
    trace = read_trace(args.trace)
    loaded = [(p, *_load_plan(p, trace, args.trace, args.topology)) for p in args.plans]
    base = next((s for _, plan, s in loaded if plan.policy == "static"), loaded[0][2])
    base_name = "static" if any(plan.policy == "static" for _, plan, _ in loaded) else "first"
    base_s = float(base.step_seconds.sum(axis=1).mean())
    out = _summary_table(f"{args.trace}: {trace.load.shape[0]} steps x {trace.load.shape[1]} "
                         f"layers, {len(loaded)} plans; speedup: step time vs {base_name}",
                         speedup=True)  # fmt: skip
    for path, plan, s in loaded:
        _summary_row(out, path, plan.policy, plan.meta.get("settings"), s=s, base_s=base_s)
    console().print(out)
    return 0


def _summary_table(title: str, speedup: bool) -> Any:
    cols = ["plan", "policy", "settings", "max/mean", "worst", "static", "solve p50 ms",
            "copies", "migrated", "x-DC bytes", "step ms", "speedup"]  # fmt: skip
    return table(title, cols if speedup else cols[:-1], left=3)


def _summary_row(
    out: Any,
    path: Path,
    policy: str,
    settings: Any,
    *,
    s: PlanSummary,
    base_s: float | None,
) -> None:
    step_ms = 1e3 * float(s.step_seconds.sum(axis=1).mean())  # a step runs every layer
    cells = [
        path.name,
        policy,
        _settings_short(policy, settings),
        f"{s.imbalance.mean():.3f}",
        f"{s.imbalance.max():.3f}",
        f"{s.static_imbalance.mean():.3f}",
        f"{1e3 * float(np.median(s.solve_seconds)):.3f}",
        f"{int(s.copies.sum()):,}",
        fmt_bytes(float(s.migrated_bytes.sum())),
        fmt_bytes(float(s.cross_dc_bytes.sum())),
        f"{step_ms:.3f}",
    ]
    if base_s is not None:
        cells.append(f"{1e3 * base_s / step_ms:.2f}x" if step_ms > 0 else "-")
    out.add_row(*cells)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _settings_short(policy: str, settings: Any) -> str:
    """Settings that differ from the policy's defaults, ``k=v`` (``defaults`` if none)."""
    if not isinstance(settings, dict):
        return "?"
    given = _flatten(settings)
    defaults: dict[str, Any] = {}
    if policy in available_policies():
        defaults = _flatten(make_policy(policy).settings.model_dump(mode="json"))
    diff = {k: v for k, v in given.items() if defaults.get(k, object()) != v}
    return " ".join(f"{k}={json.dumps(v)}" for k, v in diff.items()) or "defaults"


def _settings_text(meta: dict[str, Any]) -> str:
    s = meta.get("settings")
    return f" ({_settings_short(str(meta.get('policy')), s)})" if isinstance(s, dict) else ""


def run_policies(args: argparse.Namespace) -> int:
    names = available_policies()
    if args.names:
        for n in names:
            print(n)
        return 0
    out = table("policies (set with --set KEY=VALUE)", ["policy", "setting", "default", "what"], 2)
    out.columns[3].justify = "left"
    for n in names:
        rows = _setting_rows(type(make_policy(n).settings))
        if not rows:
            out.add_row(n, "-", "", "no settings")
        for j, (key, default, what) in enumerate(rows):
            out.add_row(n if j == 0 else "", key, default, what)
    console().print(out)
    return 0


def _setting_rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += _setting_rows(ann, f"{prefix}{name}.")
            continue
        default = f.get_default(call_default_factory=True)
        rows.append((f"{prefix}{name}", json.dumps(default), f.description or ""))
    return rows
