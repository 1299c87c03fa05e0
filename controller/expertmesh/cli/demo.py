"""``expertmesh demo``: train a small MoE language model across simulated DCs on local Ray.

``--address`` runs on an existing Ray cluster (one or more nodes per DC, labeled
``dc=<name>`` as the topology names them, e.g. ``deploy/emulate`` or ``ray up``) instead
of starting the in-process one; ``--no-shaper`` leaves real links unshaped.

The controller actor serves REST + dashboard + ``/metrics`` and gRPC (the
control-plane surfaces, ``expertmesh serve``'s defaults: 127.0.0.1, ports 8700
and 8701) while it trains; without ``--exit`` they stay up until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from expertmesh.cli.common import json_object
from expertmesh.formats import read_topology
from expertmesh.planner import Topology, available_policies

__all__ = ["add_parser", "build_settings"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="train a small MoE LM across simulated DCs on a local Ray cluster",
        description="Start a local Ray cluster with one node per DC (labeled dc=<name>), a "
        "controller actor and one worker actor per rank; train a byte-level MoE language model "
        "on real text with expert parallelism across DCs over shaped WAN links; print loss and "
        "step time live.",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=60,
        help="training steps (default 60; with --resume the run's total)",
    )
    p.add_argument(
        "--policy",
        help="placement policy: " + ", ".join(available_policies()) + " (default: hybrid when "
        "registered, else the first of quota, eplb, static)",
    )
    p.add_argument(
        "--trigger",
        default="every_n:5",
        help="when to re-plan: every_step, every_n:N or threshold:X (default every_n:5)",
    )
    p.add_argument(
        "--policy-settings",
        help="the policy's settings as a JSON object, e.g. '{\"period\": 4}' "
        "(`expertmesh plan policies` lists them)",
    )
    p.add_argument("--topology", type=Path, help="topology YAML (else --dcs x --ranks-per-dc)")
    p.add_argument("--dcs", type=int, default=3, help="DCs (default 3)")
    p.add_argument("--ranks-per-dc", type=int, default=3, help="ranks per DC (default 3)")
    p.add_argument("--masters", type=int, default=3, help="master slots per rank (default 3)")
    p.add_argument("--spare", type=int, default=2, help="spare slots per rank (default 2)")
    p.add_argument("--inter-dc-gbps", type=float, help="inter-DC bandwidth (default 1)")
    p.add_argument("--inter-dc-latency-ms", type=float, help="inter-DC latency (default 20)")
    p.add_argument("--no-shaper", action="store_true", help="do not shape inter-DC links")
    p.add_argument(
        "--no-balance",
        action="store_true",
        help="turn the fast loop off (quota inside each DC on every microbatch's exact counts); "
        "tokens then split by the committed plan's route",
    )
    p.add_argument(
        "--no-planner-level",
        action="store_true",
        help="do not solve the planner's level on every step's exact counts (the controller's "
        "imbalance_planner, beside the measured imbalance)",
    )
    p.add_argument(
        "--address",
        help="run on this existing Ray cluster (e.g. 10.0.0.1:6379; its nodes labeled "
        "dc=<name> as in the topology) instead of starting a local one; pair with --no-shaper "
        "on real links",
    )
    p.add_argument("--corpus", type=Path, help="text file to train on (default: Python's stdlib)")
    p.add_argument(
        "--experts",
        type=int,
        default=24,
        help="experts per layer (default 24: more than a DC's 15 slots, so each DC holds a subset)",
    )
    p.add_argument("--layers", type=int, default=2, help="MoE layers (default 2)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    p.add_argument("--hidden", type=int, default=32, help="model width (default 32)")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per microbatch")
    p.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="microbatches per optimizer step (default 1)",
    )
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json",
        type=Path,
        help="write per-step results here; trace.npz and plans.npz (what the run trained on, "
        "for `expertmesh sim replay`) go beside it",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="write the expert checkpoints here (default: the run's temp dir, removed at exit)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=5,
        help="steps between expert checkpoints (default 5; 0: the initial one only)",
    )
    p.add_argument(
        "--checkpoint-keep", type=int, default=3, help="newest checkpoints kept (default 3)"
    )
    p.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="go on from the newest checkpoint in DIR (a run's --checkpoint-dir; it keeps "
        "writing there unless --checkpoint-dir says otherwise): give the flags the run trained "
        "with (model, topology, corpus must match) and --steps as the run's total",
    )
    p.add_argument(
        "--no-replace",
        action="store_true",
        help="do not replace a dead worker: its rank stays out, the others train on as a "
        "smaller data-parallel group",
    )
    p.add_argument(
        "--step-deadline",
        type=float,
        default=0.0,
        help="a collective that waits this long for a peer fails (a dead peer, a real DC cut; "
        "default 0: 60 s)",
    )
    p.add_argument("--host", help="address REST and gRPC bind to (default 127.0.0.1)")
    p.add_argument(
        "--rest-port",
        type=int,
        help="REST, dashboard and /metrics port (default 8700; 0: any free)",
    )
    p.add_argument("--grpc-port", type=int, help="gRPC port (default 8701; 0: any free)")
    p.add_argument("--no-serve", action="store_true", help="do not start REST/dashboard/gRPC")
    p.add_argument("--exit", action="store_true", help="exit after training (else wait for Ctrl-C)")
    p.set_defaults(func=run)


def parse_trigger(text: str) -> dict[str, Any]:
    mode, _, val = text.partition(":")
    if mode == "every_step" and not val:
        return {"mode": "every_step"}
    if mode == "every_n" and val.isdigit():
        return {"mode": "every_n", "every": int(val)}
    if mode == "threshold" and val:
        try:
            return {"mode": "threshold", "threshold": float(val)}
        except ValueError:
            pass
    raise ValueError(f"--trigger {text!r}: use every_step, every_n:N or threshold:X")


def build_settings(args: argparse.Namespace) -> Any:
    """The :class:`RuntimeSettings` the arguments describe (ValueError on bad input)."""
    from expertmesh.workers.model import LMConfig

    if args.policy is None:
        have = available_policies()
        args.policy = next(p for p in ("hybrid", "quota", "eplb", "static") if p in have)
    if args.policy not in available_policies():
        raise ValueError(
            f"unknown policy {args.policy!r}; choose from {', '.join(available_policies())}"
        )
    if args.steps < 1:
        raise ValueError("--steps must be >= 1")
    if args.topology is not None:
        topo = read_topology(args.topology)  # hostile-safe: size, UTF-8, alias bombs, depth
    else:
        topo = Topology.generate(
            args.dcs, args.ranks_per_dc, masters=args.masters, spare=args.spare
        ).with_inter_dc(1.0, 20.0)
    if args.inter_dc_gbps is not None or args.inter_dc_latency_ms is not None:
        gbps = args.inter_dc_gbps if args.inter_dc_gbps is not None else topo.inter_dc.gbps
        topo = topo.with_inter_dc(gbps, args.inter_dc_latency_ms)
    if not 0 <= args.step_deadline < float("inf"):
        raise ValueError(f"--step-deadline must be finite and >= 0, got {args.step_deadline}")
    if args.checkpoint_every < 0 or args.checkpoint_keep < 1:
        raise ValueError("--checkpoint-every must be >= 0 and --checkpoint-keep >= 1")
    if getattr(args, "resume", None) is not None and args.checkpoint_dir is None:
        args.checkpoint_dir = args.resume
    ckdir = args.checkpoint_dir
    if ckdir is not None and ckdir.exists() and not ckdir.is_dir():
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir} is not a directory")
    if args.corpus is not None and not args.corpus.is_file():
        raise FileNotFoundError(2, "No such file", str(args.corpus))
    lm = LMConfig(
        num_layers=args.layers,
        num_experts=args.experts,
        top_k=args.top_k,
        hidden=args.hidden,
        batch=args.batch,
        microbatches=args.microbatches,
        seq_len=args.seq_len,
        seed=args.seed,
    )
    if lm.num_experts > topo.num_ranks * topo.masters_per_rank:
        raise ValueError(
            f"{lm.num_experts} experts do not fit {topo.num_ranks} ranks x "
            f"{topo.masters_per_rank} master slots"
        )
    try:
        return _runtime_settings(args, topo, lm)
    except ValidationError as err:
        raise ValueError(_first_error(err)) from None


def _runtime_settings(args: argparse.Namespace, topo: Topology, lm: Any) -> Any:
    from expertmesh.controller.core import Trigger
    from expertmesh.runtime.settings import RuntimeSettings

    return RuntimeSettings(
        topology=topo.to_dict(),
        lm=lm,
        policy=args.policy,
        policy_settings=_policy_settings(args),
        trigger=Trigger(**parse_trigger(args.trigger)),
        shaper=not args.no_shaper,
        balance=not args.no_balance,
        corpus=str(args.corpus) if args.corpus else None,
        surfaces=None if args.no_serve else _surface_settings(args),
        checkpoint_every=args.checkpoint_every,
        checkpoint_dir=str(args.checkpoint_dir) if args.checkpoint_dir else None,
        checkpoint_keep=args.checkpoint_keep,
        trace_dir=str(args.json.parent) if args.json else None,
        planner_level=not args.no_planner_level,
        replace_dead_workers=not args.no_replace,
        step_deadline_s=args.step_deadline,
    )


#: hybrid's settings under the fast loop unless --policy-settings says otherwise: one slot
#: per rank left free for the fast loop's replicas; the holder sets evened out for the split
#: by DC (even_dcs); the slow loop re-planned at every plan (every 5 steps, the trigger's
#: default) on the newest load window only (routing drifts fast while the model trains)
FAST_LOOP_HYBRID = {"reserve_slots": 1, "even_dcs": True, "period": 5, "window": 1}


def _policy_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``--policy-settings``; with the fast loop on, hybrid's :data:`FAST_LOOP_HYBRID`
    fill in what the settings do not say."""
    given = json_object(args.policy_settings, "--policy-settings")
    if args.policy == "hybrid" and not args.no_balance:
        given = {**FAST_LOOP_HYBRID, **given}
    return given


def _first_error(err: ValidationError) -> str:
    e = err.errors()[0]
    where, msg = ".".join(map(str, e["loc"])), str(e["msg"]).removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def _surface_settings(args: argparse.Namespace) -> Any:
    from expertmesh.controller.settings import SurfaceSettings

    given = {"host": args.host, "rest_port": args.rest_port, "grpc_port": args.grpc_port}
    try:
        return SurfaceSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as err:
        raise ValueError(_first_error(err)) from None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from expertmesh.runtime.spmd import SpmdRuntime

    settings = build_settings(args)
    resume, steps = _resume(args, settings)
    logging.basicConfig(level=logging.WARNING)
    console = Console()
    topo = Topology.from_dict(settings.topology)
    console.print(
        f"[bold]expertmesh demo[/]: {topo.num_dcs} DCs x {topo.num_ranks // topo.num_dcs} ranks, "
        f"inter-DC {topo.inter_dc.gbps:g} Gbit/s {topo.inter_dc.latency_ms:g} ms"
        f"{'' if settings.shaper else ' (shaper off)'}, policy {settings.policy} "
        f"{json.dumps(settings.policy_settings) if settings.policy_settings else ''}, "
        f"fast loop {'on' if settings.balance else 'off'}, "
        f"{settings.lm.num_experts} experts x {settings.lm.num_layers} layers, top-{settings.lm.top_k}"
    )
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops as cleanly as Ctrl-C
    t0 = time.perf_counter()
    try:
        rt_args: dict[str, Any] = {"resume": resume} if resume is not None else {}
        with SpmdRuntime(settings, address=args.address, **rt_args) as rt:
            console.print(
                f"{'connected to ' + args.address if args.address else 'cluster up'} in {time.perf_counter() - t0:.1f}s; workers on {rt.node_dcs()}"
            )
            if rt.surfaces is not None:
                url, target = rt.surfaces["rest_url"], rt.surfaces["grpc_target"]
                console.print(f"  dashboard  {url}/")
                console.print(f"  REST       {url}/api/v1  (OpenAPI {url}/docs)")
                console.print(f"  metrics    {url}/metrics")
                console.print(f"  gRPC       {target}  (expertmesh.v1.ExpertMeshService)")
            if resume is not None:
                console.print(
                    f"resumed from {resume.path}: step {resume.step} trained, plan "
                    f"v{resume.version}; {steps} steps to go"
                )
            rows = _train(rt, steps, console)
            status = rt.status()
            summary = _summary(rows, status, settings)
            summary["resumed"] = status.get("resumed")
            summary["controller_outages"] = status.get("controller_outages", [])
            summary["backend"] = rt.backend
            console.print(
                f"trained {len(rows)} steps in {time.perf_counter() - t0:.1f}s: loss "
                f"{rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}, median step "
                f"{summary['median_step_seconds']:.3f}s, plan v{status['version']}, "
                f"controller errors {status['errors']}"
            )
            console.print(_imbalance_line(summary))
            if args.json is not None:
                args.json.write_text(json.dumps({"summary": summary, "steps": rows}, indent=1))
                console.print(f"wrote {args.json}")
            if not args.exit:
                console.print("cluster and surfaces are up; Ctrl-C to stop")
                while True:
                    time.sleep(1.0)
    except KeyboardInterrupt:
        console.print("stopped")
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _resume(args: argparse.Namespace, settings: Any) -> tuple[Any, int]:
    """``--resume``: the checkpoint to go on from (checked before anything starts: a bad
    directory is one line and exit 2) and the steps left of ``--steps``."""
    if args.resume is None:
        return None, args.steps
    from expertmesh.runtime.resume import load_resume

    rs = load_resume(args.resume, settings)
    left = args.steps - (rs.step + 1)
    if left < 1:
        raise ValueError(
            f"--resume {args.resume}: the run has trained {rs.step + 1} steps already; "
            f"--steps {args.steps} leaves none (--steps is the run's total)"
        )
    return rs, left


def _imbalance_line(summary: dict[str, Any]) -> str:
    """The summary's imbalance medians in one line."""
    level = summary["median_imbalance_planner"]
    return (
        f"imbalance (max/mean, worst microbatch and layer) median from step {WARMUP_STEPS}: "
        f"measured {summary['median_imbalance']:.3f}"
        + (f", planner's level on the same tokens {level:.3f}" if level is not None else "")
    )


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _train(rt: Any, steps: int, console: Any) -> list[dict[str, Any]]:
    from rich import box
    from rich.live import Live
    from rich.table import Table

    rows: list[dict[str, Any]] = []
    # compact (no borders): fits an 80-column console. s: end-to-end step seconds;
    # max/mean: measured, the planner's level and static EP on the same tokens; WAN MB
    # between DCs: tokens, replica weights, migration
    table = Table(
        "step", "loss", "s", "max/mean", "planner", "static", "plan", "WAN MB tok", "wts",
        "migr", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True,
    )  # fmt: skip

    def show(r: Any) -> None:
        rows.append(r.model_dump())
        table.add_row(
            str(r.step),
            f"{r.loss:.4f}",
            f"{r.seconds if r.seconds is not None else r.step_seconds:.3f}",
            f"{r.imbalance:.3f}",
            f"{r.imbalance_planner:.3f}" if r.imbalance_planner is not None else "",
            f"{r.imbalance_static:.2f}" if r.imbalance_static is not None else "",
            f"v{r.plan_version}",
            _mb(r.cross_dc_token_bytes),
            _mb(r.cross_dc_weight_bytes),
            _mb(r.cross_dc_migration_bytes) if r.cross_dc_migration_bytes else "",
        )
        if len(table.rows) > 20:
            table.rows.pop(0)
            for col in table.columns:
                col._cells.pop(0)

    with Live(table, console=console, refresh_per_second=4, transient=False):
        rt.train(steps, on_step=show)
    if not console.is_terminal:  # Live leaves a redirected output on the table's last line
        console.line()
    return rows


#: the summary's medians of the per-step imbalance start here (the first plans switch in
#: after steps 6-7 with the default trigger)
WARMUP_STEPS = 10


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def _summary(rows: list[dict[str, Any]], status: dict[str, Any], settings: Any) -> dict[str, Any]:
    import statistics

    writes = [c["write_seconds"] for c in status.get("checkpoints", [])]
    after = [r for r in rows if r["step"] >= WARMUP_STEPS] or rows
    levels = [r["imbalance_planner"] for r in after if r.get("imbalance_planner") is not None]
    return {
        "policy": settings.policy,
        "steps": len(rows),
        "first_loss": rows[0]["loss"],
        "final_loss": rows[-1]["loss"],
        "median_step_seconds": statistics.median(
            r["seconds"] if r.get("seconds") is not None else r["step_seconds"] for r in rows
        ),
        # per-step imbalance (max over microbatches and layers) from step WARMUP_STEPS on:
        # measured, and the planner's level on the same exact counts
        "median_imbalance": statistics.median(r["imbalance"] for r in after),
        "median_imbalance_planner": statistics.median(levels) if levels else None,
        "plan_version": status["version"],
        "controller_errors": status["errors"],
        "retried_steps": status.get("retried_steps", []),
        "dead_ranks": status.get("dead_ranks", []),
        "recoveries": status.get("recoveries", []),
        "replacements": status.get("replacements", []),
        "checkpoints": status.get("checkpoints", []),
        "checkpoint_write_ms_median": 1e3 * statistics.median(writes) if writes else None,
        "topology": settings.topology,
        "lm": settings.lm.model_dump(),
    }
