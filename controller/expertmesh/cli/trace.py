"""``expertmesh trace``: generate synthetic gating traces, import engines' load, inspect traces."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from expertmesh.cli.engines import add_import_parser
from expertmesh.cli.main import UsageError
from expertmesh.cli.output import console, fmt_bytes, table
from expertmesh.formats import read_topology, read_trace, write_trace
from expertmesh.planner.trace import TraceSettings, generate_trace, static_imbalance

__all__ = ["add_parser"]

# TraceSettings field -> the flag that sets it (for error messages)
_FLAGS = {
    "num_ranks": "--ranks",
    "num_experts": "--experts",
    "num_layers": "--layers",
    "num_steps": "--steps",
    "top_k": "--top-k",
    "tokens_per_rank": "--tokens-per-rank",
    "imbalance": "--imbalance",
    "drift": "--drift",
    "regime_every": "--regime-every",
    "seed": "--seed",
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "trace",
        help="generate synthetic gating traces; import engine load statistics; inspect traces",
        description="Traces are .npz files with load [T, L, R, E] (README: Interchange formats).",
    )
    actions = p.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    g = actions.add_parser(
        "generate",
        help="write a synthetic trace calibrated to a static-EP imbalance",
        description="Zipf-skewed expert popularity over a random order per layer, exponent "
        "found by bisection so that static EP's expected max/mean rank load equals "
        "--imbalance; each token picks --top-k distinct experts. Optional drift (the hot set "
        "moves slowly) and regime switches (a new order every N steps). Seeded.",
    )
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--topology", type=Path, help="topology YAML: ranks (and DCs) from it")
    src.add_argument("--ranks", type=int, help="number of ranks R (no topology)")
    g.add_argument("--out", type=Path, required=True, help="trace file to write (.npz)")
    g.add_argument("--experts", type=int, default=256, help="experts per layer E (256)")
    g.add_argument("--layers", type=int, default=1, help="MoE layers L (1)")
    g.add_argument("--steps", type=int, default=10, help="microbatches T (10)")
    g.add_argument("--top-k", type=int, default=8, help="experts per token (8)")
    g.add_argument("--tokens-per-rank", type=int, default=8192, help="tokens per rank (8192)")
    g.add_argument(
        "--imbalance", type=float, default=2.0, help="target max/mean under static EP (2.0)"
    )
    g.add_argument(
        "--drift",
        type=float,
        default=0.0,
        help="share of experts swapped with a popularity neighbour per step (0: none)",
    )
    g.add_argument(
        "--regime-every", type=int, default=0, help="new popularity order every N steps (0: never)"
    )
    g.add_argument("--seed", type=int, default=0, help="random seed (0)")
    g.add_argument("--hidden", type=int, help="model width, recorded in meta for `plan`")
    g.add_argument("--ffn-hidden", type=int, help="expert FFN width, recorded in meta")
    g.set_defaults(func=run_generate)

    i = actions.add_parser("inspect", help="print a trace file's shape, meta and imbalance")
    i.add_argument("trace", type=Path, help="trace file (.npz)")
    i.set_defaults(func=run_inspect)

    add_import_parser(actions)


def _settings(args: argparse.Namespace, num_ranks: int) -> TraceSettings:
    try:
        return TraceSettings(
            num_ranks=num_ranks,
            num_experts=args.experts,
            num_layers=args.layers,
            num_steps=args.steps,
            top_k=args.top_k,
            tokens_per_rank=args.tokens_per_rank,
            imbalance=args.imbalance,
            drift=args.drift,
            regime_every=args.regime_every,
            seed=args.seed,
        )
    except ValidationError as err:
        e = err.errors()[0]
        flag = _FLAGS.get(str(e["loc"][0]), str(e["loc"][0])) if e["loc"] else ""
        msg = str(e["msg"]).removeprefix("Value error, ")
        raise UsageError(f"{flag}: {msg}" if flag else msg) from None


def run_generate(args: argparse.Namespace) -> int:
    meta_extra: dict[str, Any] = {}
    if args.topology is not None:
        topo = read_topology(args.topology)
        num_ranks = topo.num_ranks
        if args.experts > num_ranks * topo.masters_per_rank:
            raise UsageError(
                f"--experts {args.experts} do not fit {args.topology}: {num_ranks} ranks x "
                f"{topo.masters_per_rank} master slots = {num_ranks * topo.masters_per_rank}"
            )
        meta_extra["dcs"] = [d.name for d in topo.dcs]
        meta_extra["ranks_per_dc"] = [d.num_ranks for d in topo.dcs]
    else:
        num_ranks = args.ranks
        if num_ranks is None or num_ranks < 1:
            raise UsageError(f"--ranks must be >= 1, got {num_ranks}")
    for flag, value in (("--hidden", args.hidden), ("--ffn-hidden", args.ffn_hidden)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    settings = _settings(args, num_ranks)
    t0 = time.perf_counter()
    trace = generate_trace(settings)
    seconds = time.perf_counter() - t0
    meta = {**trace.meta, **meta_extra}
    if args.hidden is not None:
        meta["hidden"] = args.hidden
    if args.ffn_hidden is not None:
        meta["ffn_hidden"] = args.ffn_hidden
    write_trace(args.out, trace.load, meta)
    realized = static_imbalance(trace.load)
    out = table(f"trace written to {args.out}", ["", ""], left=2, show_header=False)
    out.add_row("load [T, L, R, E]", " x ".join(map(str, trace.load.shape)))
    out.add_row("top-k, tokens per rank", f"{settings.top_k}, {settings.tokens_per_rank}")
    out.add_row("static EP max/mean: target", f"{settings.imbalance:.3f}")
    out.add_row(
        "static EP max/mean: sampled",
        f"mean {realized.mean():.3f}  min {realized.min():.3f}  max {realized.max():.3f}",
    )
    out.add_row("Zipf exponent", f"{trace.exponent.min():.4f} .. {trace.exponent.max():.4f}")
    out.add_row("drift, regime every", f"{settings.drift:g}, {settings.regime_every or 'never'}")
    out.add_row("file size", fmt_bytes(args.out.stat().st_size))
    out.add_row("generated in", f"{seconds:.2f} s")
    console().print(out)
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace)
    load = trace.load
    imb = static_imbalance(load)
    out = table(str(args.trace), ["", ""], left=2, show_header=False)
    out.add_row("load [T, L, R, E]", " x ".join(map(str, load.shape)))
    per_step = load.sum(axis=(1, 2, 3))
    out.add_row("assignments per step", f"{int(per_step.mean()):,} (mean over steps)")
    out.add_row(
        "static EP max/mean",
        f"mean {imb.mean():.3f}  min {imb.min():.3f}  max {imb.max():.3f}",
    )
    hot = np.argsort(-load.sum(axis=(0, 2)), axis=1)[:, :5]  # [L, 5]
    out.add_row("hottest experts (layer 0)", ", ".join(map(str, hot[0].tolist())))
    for key in ("top_k", "tokens_per_rank", "ranks_per_dc", "hidden", "ffn_hidden"):
        if key in trace.meta:
            out.add_row(f"meta {key}", str(trace.meta[key]))
    eng = trace.meta.get("engine")
    if isinstance(eng, dict):
        layers = eng.get("layers")
        n = len(layers) if isinstance(layers, list) else "?"
        out.add_row(
            "imported from",
            f"{eng.get('format', '?')}: {eng.get('source', '?')} ({n} engine layers)",
        )
    gen = trace.meta.get("generator")
    if isinstance(gen, dict) and isinstance(gen.get("settings"), dict):
        s = gen["settings"]
        out.add_row(
            "generator",
            f"{gen.get('name', '?')}: imbalance {s.get('imbalance')}, drift {s.get('drift')}, "
            f"regime every {s.get('regime_every')}, seed {s.get('seed')}",
        )
    console().print(out)
    return 0
