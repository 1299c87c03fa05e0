"""``expertmesh trace import`` and ``expertmesh plan export``: the serving engines' files.

See docs/engines.md for the walkthrough and the engine versions these formats follow.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from expertmesh.cli.main import UsageError
from expertmesh.cli.output import console, fmt_bytes, table
from expertmesh.engines.files import read_export, write_export
from expertmesh.engines.load import IMPORT_FORMATS, import_trace
from expertmesh.engines.placement import ENGINES, EngineLayout
from expertmesh.formats import PlanFile, read_plan, read_topology, write_trace
from expertmesh.planner.trace import static_imbalance

__all__ = ["add_export_parser", "add_import_parser", "engine_layout", "plan_experts"]


def add_import_parser(actions: Any) -> None:
    i = actions.add_parser(
        "import",
        help="read an engine's expert-load statistics as a trace",
        description="Read TensorRT-LLM's expert statistics directory (EXPERT_STATISTIC_PATH), "
        "SGLang's expert distribution dump (logical_count, .pt or .json) or a per-token routing "
        "table (.npy, .npz or .parquet) and write a trace (.npz). docs/engines.md has the layouts.",
    )
    i.add_argument("source", type=Path, help="the statistics: a directory (trtllm) or a file")
    i.add_argument("--format", required=True, choices=IMPORT_FORMATS, help="what wrote it")
    i.add_argument("--out", type=Path, required=True, help="trace file to write (.npz)")
    src = i.add_mutually_exclusive_group()
    src.add_argument("--topology", type=Path, help="topology YAML: ranks (and DCs) from it")
    src.add_argument("--ranks", type=int, help="source ranks R (sglang; routing without 'rank')")
    i.add_argument(
        "--tokens-per-step", type=int, help="routing: tokens per step (default: one step)"
    )
    i.add_argument("--experts", type=int, help="routing: experts E (default: largest id + 1)")
    i.set_defaults(func=run_import)


def run_import(args: argparse.Namespace) -> int:
    meta_extra: dict[str, Any] = {}
    ranks = args.ranks
    if args.topology is not None:
        topo = read_topology(args.topology)
        ranks = topo.num_ranks
        meta_extra = {
            "dcs": [d.name for d in topo.dcs],
            "ranks_per_dc": [d.num_ranks for d in topo.dcs],
        }
    trace = import_trace(
        args.source, args.format, num_ranks=ranks, tokens_per_step=args.tokens_per_step,
        num_experts=args.experts,
    )  # fmt: skip
    if meta_extra and trace.load.shape[2] != ranks:
        raise UsageError(
            f"{args.source} has {trace.load.shape[2]} ranks, {args.topology} has {ranks}"
        )
    meta = {**trace.meta, **meta_extra}
    write_trace(args.out, trace.load, meta)
    imb = static_imbalance(trace.load)
    layers = meta["engine"]["layers"]
    out = table(f"trace written to {args.out}", ["", ""], left=2, show_header=False)
    out.add_row("load [T, L, R, E]", " x ".join(map(str, trace.load.shape)))
    out.add_row("from", f"{args.format}: {args.source}")
    out.add_row("engine layers kept", _ids(layers))
    out.add_row("assignments", f"{int(trace.load.sum()):,}")
    out.add_row(
        "static EP max/mean", f"mean {imb.mean():.3f}  min {imb.min():.3f}  max {imb.max():.3f}"
    )
    if "top_k" in meta:
        out.add_row("top-k", str(meta["top_k"]))
    out.add_row("file size", fmt_bytes(args.out.stat().st_size))
    console().print(out)
    return 0


def _ids(ids: list[int]) -> str:
    if ids and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]} ({len(ids)})"
    return ", ".join(map(str, ids[:12])) + (" ..." if len(ids) > 12 else "")


# ---------------------------------------------------------------------------
# plan export
# ---------------------------------------------------------------------------


def add_export_parser(actions: Any) -> None:
    e = actions.add_parser(
        "export",
        help="write one step of a plan as an engine's expert placement",
        description="SGLang: --init-expert-location map (.json or .pt); TensorRT-LLM: MoE load "
        "balancer config (.yaml); vLLM: its EPLB maps (.safetensors or .json). A plan with empty "
        "slots or unplaced experts cannot be expressed and is refused. The file is read back and "
        "compared before the command succeeds.",
    )
    e.add_argument("plan", type=Path, help="plan file (.npz)")
    e.add_argument("--format", required=True, choices=ENGINES, help="the engine")
    e.add_argument("--out", type=Path, required=True, help="placement file to write")
    e.add_argument("--step", type=int, default=-1, help="plan step to export (default: the last)")
    ids = e.add_mutually_exclusive_group()
    ids.add_argument(
        "--layer-offset", type=int, help="engine layer of plan layer 0 (dense layers first)"
    )
    ids.add_argument("--layer-ids", help="engine layer of each plan layer, comma-separated")
    e.add_argument("--num-model-layers", type=int, help="sglang: the model's num_hidden_layers")
    e.add_argument("--layer-updates-per-iter", type=int, default=0,
                   help="trtllm: layers updated online per iteration (0: static)")  # fmt: skip
    e.set_defaults(func=run_export)


def plan_experts(plan: PlanFile) -> int:
    """The plan's expert count: its masters, else its meta's model, else the largest id + 1."""
    if plan.master is not None:
        return int(plan.master.shape[2])
    model = plan.meta.get("model")
    if isinstance(model, dict) and isinstance(model.get("num_experts"), int):
        return int(model["num_experts"])
    return int(plan.phy2log.max()) + 1


def engine_layout(
    num_layers: int,
    meta: dict[str, Any],
    layer_offset: int | None,
    layer_ids: str | None,
    num_model_layers: int | None,
) -> EngineLayout:
    """Engine layer ids from the flags, else from the plan's ``engine`` meta (an imported
    trace's layers), else ``0 .. L-1``."""
    ids: list[int] | None = None
    if layer_ids is not None:
        try:
            ids = [int(x) for x in layer_ids.split(",") if x.strip()]
        except ValueError:
            raise UsageError(
                f"--layer-ids must be integers separated by commas, got {layer_ids!r}"
            ) from None
    elif layer_offset is None:
        eng = meta.get("engine")
        got = eng.get("layers") if isinstance(eng, dict) else None
        if isinstance(got, list) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in got
        ):
            ids = got
    return EngineLayout.make(
        num_layers, layer_offset=layer_offset or 0, layer_ids=ids, num_model_layers=num_model_layers
    )


def run_export(args: argparse.Namespace) -> int:
    plan = read_plan(args.plan)
    num_steps, num_layers, num_ranks, num_slots = plan.shape
    step = args.step if args.step >= 0 else num_steps + args.step
    if not 0 <= step < num_steps:
        raise UsageError(f"--step {args.step}: {args.plan} has steps 0..{num_steps - 1}")
    num_experts = plan_experts(plan)
    layout = engine_layout(num_layers, plan.meta, args.layer_offset, args.layer_ids,
                           args.num_model_layers)  # fmt: skip
    phy2log = plan.phy2log[step]  # [L, R, S]
    write_export(args.out, phy2log, num_experts, args.format, layout,
                 layer_updates_per_iter=args.layer_updates_per_iter)  # fmt: skip
    back = read_export(args.out, args.format, num_ranks=num_ranks, num_experts=num_experts,
                       layout=layout)  # fmt: skip
    if not np.array_equal(back, phy2log):  # a bug here, never the user's input
        args.out.unlink(missing_ok=True)
        raise RuntimeError(f"{args.out} does not read back as step {step} of {args.plan}")
    physical = num_ranks * num_slots
    out = table(
        f"{args.format} placement written to {args.out}", ["", ""], left=2, show_header=False
    )
    out.add_row("plan step", f"{step} of {args.plan} (policy {plan.policy})")
    out.add_row("EP size, slots per rank", f"{num_ranks}, {num_slots}")
    out.add_row(
        "physical experts", f"{physical} = {num_experts} + {physical - num_experts} redundant"
    )
    out.add_row("engine layers", _ids(list(layout.layer_ids)))
    out.add_row("read back", "equal")
    out.add_row("start the engine with", _engine_flags(args.format, args.out, num_ranks,
                                                      physical - num_experts))  # fmt: skip
    out.add_row("file size", fmt_bytes(args.out.stat().st_size))
    console().print(out)
    return 0


def _engine_flags(fmt: str, path: Path, ranks: int, redundant: int) -> str:
    if fmt == "sglang":
        return (f"--init-expert-location {path} --ep-size {ranks} "
                f"--ep-num-redundant-experts {redundant}")  # fmt: skip
    if fmt == "trtllm":
        return f"moe_config: {{load_balancer: {path}}} with --ep_size {ranks}"
    return (
        f"EP size {ranks}, --eplb-config '{{\"num_redundant_experts\": {redundant}}}'; "
        "vLLM has no loader for the maps (docs/engines.md)"
    )
