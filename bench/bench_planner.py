"""Planner benchmark (issue 2): balance, solve time and migration traffic at EP64.

EP64 (deploy/topologies/ep64.yaml: 8 nodes x 8 ranks, 4 masters + 2 spare slots
per rank), 256 experts, top-8, 8192 tokens per rank, one domain.

1. Balance: traces whose static-EP max/mean is 1.5, 2.0 and 3.0. History-based
   policies (``eplb``, the peer) plan on the ``window`` microbatches before the
   final one; everything is scored on the final microbatch (max/mean tokens per
   rank, routed with the same ``route_even`` for ``eplb`` and the peer).
   Solve time per layer = one layer planned from numpy load to placement and
   route, timed the same way for everyone (the peer: DeepSeek's
   ``rebalance_experts`` from the pinned sglang wheel, ``scripts/peer_eplb.py``, plus the same route);
   "placement only" times ``rebalance`` against the peer's ``rebalance_experts``
   on the same weight.
2. Drift: 100 steps of slowly drifting load (the generator's ``drift``: a share of
   experts swaps with a near popularity position each step); bytes migrated per step by ``eplb``
   through ``plan_trace`` (aligned placement, planned migration) vs re-running the
   peer every ``period`` steps and replacing slot by slot (every slot whose expert
   changes is one expert copy sent).

Single core: BLAS/OpenMP threads and torch threads are set to 1; times are
process CPU time; glibc keeps freed memory (see ``MALLOC_VARS``). Medians over
repeats; ratios are against baselines measured in the same run.

    make bench-planner      # or: python bench/bench_planner.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
for _root in ("controller", "workers", "proto"):
    if str(REPO / _root) not in sys.path:
        sys.path.insert(0, str(REPO / _root))

from expertmesh.planner import (  # noqa: E402 (after the source roots are on sys.path)
    LayerPlan,
    ModelSpec,
    Placement,
    Policy,
    PolicyContext,
    Topology,
    TransferKind,
    available_policies,
    imbalance,
    make_policy,
    plan_layer,
    plan_trace,
)
from expertmesh.planner.eplb import EplbPolicy, rebalance  # noqa: E402
from expertmesh.planner.migration import plan_migration  # noqa: E402
from expertmesh.planner.routing import route_even  # noqa: E402
from expertmesh.planner.trace import TraceSettings, generate_trace  # noqa: E402

TOP_K = 8
TOKENS_PER_RANK = 8192
NUM_EXPERTS = 256
NUM_RANKS = 64
IMBALANCES = (1.5, 2.0, 3.0)
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# glibc: keep freed blocks in the heap instead of returning each large array to the OS
# (what its adaptive threshold does in a long-running controller anyway); otherwise a
# solve's time swings 2-3x with page faults depending on what ran before it.
MALLOC_VARS = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(512 << 20)}

console = Console()


# ---------------------------------------------------------------------------
# Load: the project's trace generator (expertmesh trace generate)
# ---------------------------------------------------------------------------


def make_trace(steps: int, target: float, seed: int, drift: float = 0.0) -> np.ndarray:
    """[T, R, E] one layer of a generated trace: Zipf-skewed experts calibrated so that
    static EP's expected max/mean is ``target``; ``drift`` = expected share of experts
    swapped (with a near popularity position) per step."""
    settings = TraceSettings(
        num_ranks=NUM_RANKS,
        num_experts=NUM_EXPERTS,
        num_steps=steps,
        top_k=TOP_K,
        tokens_per_rank=TOKENS_PER_RANK,
        imbalance=target,
        drift=drift,
        seed=seed,
    )
    return generate_trace(settings).load[:, 0]


# ---------------------------------------------------------------------------
# The peer: DeepSeek EPLB as shipped in sglang (torch), run in this process
# ---------------------------------------------------------------------------


def load_peer() -> tuple[ModuleType | None, str]:
    """DeepSeek's ``deepseek_eplb`` module and ``""``, or ``None`` and why not
    (EXPERTMESH_PEER_EPLB, else fetched from the pinned sglang wheel: scripts/peer_eplb.py)."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    torch.set_num_threads(1)
    path = os.environ.get("EXPERTMESH_PEER_EPLB")
    if path is None:
        spec = importlib.util.spec_from_file_location(
            "peer_eplb_tool", REPO / "scripts/peer_eplb.py"
        )
        if spec is None or spec.loader is None:
            return None, "cannot load scripts/peer_eplb.py"
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
        try:
            path = str(tool.fetch(REPO / ".cache" / "peers"))
        except tool.PeerUnavailable as err:
            return None, str(err)
    spec = importlib.util.spec_from_file_location("deepseek_eplb_peer", path)
    if spec is None or spec.loader is None:
        return None, f"cannot load {path}"
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, ""


def peer_phy2log(peer: ModuleType, weight: np.ndarray, args: tuple[int, ...], hier: bool) -> Any:
    import torch

    return peer.rebalance_experts(torch.from_numpy(weight[None]), *args, hier)[0][0].numpy()


# ---------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median CPU seconds of ``fn()`` (process CPU time: single-threaded here, and not
    inflated by other processes sharing the machine)."""
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return float(np.median(times))


def first_master(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """[E] flat slot of the first copy of each expert (a valid master for routing)."""
    experts, first = np.unique(phy2log.ravel(), return_index=True)
    out = np.empty(num_experts, dtype=np.int64)
    out[experts] = first
    return out


Contender = Callable[[np.ndarray, np.ndarray], LayerPlan]  # (load [R, E], history [W, R, E])


def _eplb_rebalance(weight: np.ndarray, args: tuple[int, ...], hier: bool) -> object:
    return rebalance(weight[None], *args, hierarchical=hier)


def contenders(
    topo: Topology, model: ModelSpec, peer: ModuleType | None
) -> dict[str, tuple[Contender, Callable[[np.ndarray], object] | None]]:
    """Name -> (plan one layer from (load, history), placement only from weight [E] or None).

    ``eplb`` and the peer run with the same arguments: the defaults (global on
    several nodes), and hierarchical with one group per node ("hier").
    """
    step = make_policy("eplb").history_window()
    num_ranks, slots = topo.num_ranks, topo.slots_per_rank
    out: dict[str, tuple[Contender, Callable[[np.ndarray], object] | None]] = {}

    def ours(policy: Policy) -> Contender:
        def plan(load: np.ndarray, history: np.ndarray) -> LayerPlan:
            return plan_layer(policy, PolicyContext(topo, model, step, 0, load, history))

        return plan

    def theirs(args: tuple[int, ...], hier: bool) -> Contender:
        assert peer is not None

        def plan(load: np.ndarray, history: np.ndarray) -> LayerPlan:
            weight = history.sum((0, 1)).astype(np.float64)
            phy2log = peer_phy2log(peer, weight, args, hier).reshape(num_ranks, slots)
            placement = Placement(phy2log, first_master(phy2log, NUM_EXPERTS))
            return LayerPlan(placement, route_even(load, placement, topo.rank_dc))

        return plan

    out["static"] = (ours(make_policy("static")), None)
    for label, cfg in (("", {}), (" hier", {"num_groups": topo.num_nodes})):
        eplb = make_policy("eplb", cfg)
        assert isinstance(eplb, EplbPolicy)
        groups, hier = eplb.resolve(topo, NUM_EXPERTS)
        args = (num_ranks * slots, groups, topo.num_nodes, num_ranks)
        out["eplb" + label] = (
            ours(eplb),
            partial(_eplb_rebalance, args=args, hier=hier),
        )
        if peer is not None:
            out["peer" + label] = (
                theirs(args, hier),
                partial(peer_phy2log, peer, args=args, hier=hier),
            )
    if "quota" in available_policies():
        out["quota"] = (ours(make_policy("quota")), None)
    return out


def balance_rows(
    topo: Topology, model: ModelSpec, peer: ModuleType | None, seeds: int, repeats: int
) -> list[dict[str, Any]]:
    """Per imbalance and contender: median max/mean on the final microbatch, median
    solve and placement-only seconds."""
    window = make_policy("eplb").history_window()
    who = contenders(topo, model, peer)
    rows: list[dict[str, Any]] = []
    for target in IMBALANCES:
        score: dict[str, list[float]] = {c: [] for c in who}
        solve: dict[str, list[float]] = {c: [] for c in who}
        place: dict[str, list[float]] = {c: [] for c in who}
        for seed in range(seeds):
            trace = make_trace(window + 1, target, seed)
            load, history = trace[-1], trace[:-1]  # [R, E], [W, R, E]
            weight = history.sum((0, 1)).astype(np.float64)
            for name, (plan, placement_only) in who.items():
                score[name].append(imbalance(plan(load, history).rank_tokens()))
                solve[name].append(median_seconds(partial(plan, load, history), repeats))
                if placement_only is not None:
                    place[name].append(median_seconds(partial(placement_only, weight), repeats))
        rows.extend(
            {
                "imbalance": target,
                "policy": c,
                "max_mean": float(np.median(score[c])),
                "solve_ms": 1e3 * float(np.median(solve[c])),
                "place_ms": 1e3 * float(np.median(place[c])) if place[c] else None,
            }
            for c in who
        )
    return rows


def drift_rows(
    topo: Topology,
    model: ModelSpec,
    peer: ModuleType | None,
    steps: int,
    seeds: int,
    drift: float,
    eplb_settings: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Migration per step under slow drift, measured over ``steps`` steps after a warm-up
    of one period (the switch from the cold-start placement to the first plan on real
    history is not counted, for anyone).

    Both sides are charged by the same ``plan_migration`` (a replica costs its weights,
    a master that changes rank its weights and optimizer state, a second copy inside
    a rank nothing). Ours: ``plan_trace`` (relabeling, slot alignment, masters kept on
    their rank when it still holds the expert). The peer: its placements as they come,
    slot by slot, each expert's master on its first copy.
    """
    eplb = make_policy("eplb", eplb_settings)
    assert isinstance(eplb, EplbPolicy)
    groups, hier = eplb.resolve(topo, NUM_EXPERTS)
    window = eplb.cfg.window
    num_ranks, slots = topo.num_ranks, topo.slots_per_rank
    args = (num_ranks * slots, groups, topo.num_nodes, num_ranks)
    ours = {"eplb": eplb} | (
        {"quota": make_policy("quota")} if "quota" in available_policies() else {}
    )
    names = list(ours) + (["peer"] if peer is not None else [])
    keys = ("slots", "masters", "bytes", "balance")
    acc: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys} for n in names}
    total = eplb.cfg.period + 1 + steps
    measured = range(eplb.cfg.period + 1, total)

    def record(name: str, plans: list[LayerPlan], migrations: list[Any]) -> None:
        slots_changed = sum(int((plans[t].phy2log != plans[t - 1].phy2log).sum()) for t in measured)
        a = acc[name]
        a["slots"].append(slots_changed / steps)
        a["masters"].append(
            sum(x.kind == TransferKind.MASTER for m in migrations for x in m.transfers) / steps
        )
        a["bytes"].append(sum(m.nbytes for m in migrations) / steps)
        a["balance"].append(float(np.mean([imbalance(plans[t].rank_tokens()) for t in measured])))

    for seed in range(seeds):
        trace = make_trace(total, 2.0, 100 + seed, drift)  # [T, R, E]
        for name, policy in ours.items():
            plans = [row[0] for row in plan_trace(trace[:, None], topo, model, policy).layers]
            record(name, plans, [plans[t].migration for t in measured])
        if peer is None:
            continue
        peer_plans: list[LayerPlan] = []
        migrations = []
        for t in range(total):
            placement = peer_plans[-1].placement if peer_plans else None
            if eplb.replans_at(t):  # the same schedule as ours
                hist = trace[max(0, t - window) : t].sum((0, 1)).astype(np.float64)
                p2l = peer_phy2log(peer, hist if hist.any() else np.ones(NUM_EXPERTS), args, hier)
                p2l = p2l.reshape(num_ranks, slots)
                new = Placement(p2l, first_master(p2l, NUM_EXPERTS))
                if placement is not None and t in measured:
                    migrations.append(plan_migration(placement, new, topo, model))
                placement = new
            assert placement is not None
            peer_plans.append(LayerPlan(placement, route_even(trace[t], placement, topo.rank_dc)))
        record("peer", peer_plans, migrations)
    return [{"policy": n} | {k: float(np.median(v)) for k, v in acc[n].items()} for n in names]


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="traces per imbalance (median)")
    ap.add_argument("--repeats", type=int, default=20, help="timed solves per trace (median)")
    ap.add_argument("--steps", type=int, default=100, help="drift steps")
    ap.add_argument(
        "--drift", type=float, default=0.01, help="share of experts swapped per drift step"
    )
    ap.add_argument(
        "--eplb-min-gain",
        type=float,
        default=0.05,
        help="eplb's min_gain in the drift run (0 re-places at every period, as the peer does)",
    )
    ap.add_argument("--quick", action="store_true", help="1 seed, 5 repeats, 30 drift steps")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--markdown", type=Path, help="also write the tables here as markdown")
    args = ap.parse_args(argv)
    want = dict.fromkeys(THREAD_VARS, "1") | MALLOC_VARS
    if any(os.environ.get(k) != v for k, v in want.items()):  # re-run: 1 thread, steady heap
        env = {**os.environ, **want}
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)
    if args.quick:
        args.seeds, args.repeats, args.steps = 1, 5, 30

    topo = Topology.from_dict(yaml.safe_load((REPO / "deploy/topologies/ep64.yaml").read_text()))
    model = ModelSpec(num_experts=NUM_EXPERTS, top_k=TOP_K, num_layers=1)
    peer, why = load_peer()
    if peer is None:
        console.print(f"[yellow]note: peer DeepSeek EPLB skipped: {why}[/]")
    if "quota" not in available_policies():
        console.print("[yellow]note: policy 'quota' is not registered yet; skipped[/]")
    eplb = make_policy("eplb")
    assert isinstance(eplb, EplbPolicy)
    groups, hier = eplb.resolve(topo, NUM_EXPERTS)
    console.print(
        f"EP{topo.num_ranks} ({topo.num_nodes} nodes), {NUM_EXPERTS} experts, "
        f"{topo.masters_per_rank}+{topo.spare_per_rank} slots/rank, top-{TOP_K}, "
        f"{TOKENS_PER_RANK} tokens/rank; eplb and peer: {'hierarchical' if hier else 'global'}, "
        f"{groups} groups, period {eplb.cfg.period}, window {eplb.cfg.window}; 1 thread"
    )

    bal = balance_rows(topo, model, peer, args.seeds, args.repeats)
    drift = drift_rows(
        topo, model, peer, args.steps, args.seeds, args.drift, {"min_gain": args.eplb_min_gain}
    )
    tables = [balance_table(bal), drift_table(drift, args.steps)]
    verdicts = targets(bal, drift)
    for title, head, body in tables:
        table = Table(title=title)
        for col in head:
            table.add_column(col, justify="right")
        for row in body:
            table.add_row(*row)
        console.print(table)
    console.print("Targets:\n" + "\n".join(f"  {v}" for v in verdicts))
    if args.markdown:
        args.markdown.write_text(markdown(tables, verdicts))
    if args.json:
        args.json.write_text(json.dumps({"balance": bal, "drift": drift}, indent=2))
    return 0


Rendered = tuple[str, list[str], list[list[str]]]  # title, header, rows


def balance_table(bal: list[dict[str, Any]]) -> Rendered:
    head = ["static max/mean", "policy", "max/mean", "solve ms p50", "placement ms p50",
            "peer solve / solve"]  # fmt: skip
    body = []
    for target in IMBALANCES:
        group = [r for r in bal if r["imbalance"] == target]
        peer_ms = next((r["solve_ms"] for r in group if r["policy"] == "peer"), None)
        for r in group:
            body.append(
                [
                    f"{target:.1f}",
                    r["policy"],
                    f"{r['max_mean']:.3f}",
                    f"{r['solve_ms']:.3f}",
                    f"{r['place_ms']:.3f}" if r["place_ms"] is not None else "",
                    f"{peer_ms / r['solve_ms']:.1f}x" if peer_ms else "",
                ]
            )
    return "Balance and solve time per layer (medians)", head, body


def drift_table(drift: list[dict[str, Any]], steps: int) -> Rendered:
    head = ["policy", "slots changed/step", "master moves/step", "MB/step", "mean max/mean",
            "bytes / peer bytes"]  # fmt: skip
    peer_bytes = next((r["bytes"] for r in drift if r["policy"] == "peer"), None)
    body = [
        [
            r["policy"],
            f"{r['slots']:.2f}",
            f"{r['masters']:.2f}",
            f"{r['bytes'] / 1e6:.0f}",
            f"{r['balance']:.3f}",
            f"{r['bytes'] / peer_bytes:.3f}" if peer_bytes else "",
        ]
        for r in drift
    ]
    return f"Slow drift over {steps} steps: migration per step (medians)", head, body


def targets(bal: list[dict[str, Any]], drift: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, each marked met or NOT met with the measured value."""

    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"

    out = []
    quota = [r for r in bal if r["policy"] == "quota"]
    peer_ms = {r["imbalance"]: r["solve_ms"] for r in bal if r["policy"] == "peer"}
    if quota:
        worst = max(r["max_mean"] for r in quota)
        slowest = max(r["solve_ms"] for r in quota)
        out.append(
            f"quota max/mean <= 1.02 at 1.5, 2.0, 3.0: {mark(worst <= 1.02)} (worst {worst:.3f})"
        )
        out.append(
            f"quota p50 <= 1 ms per layer: {mark(slowest <= 1.0)} (slowest {slowest:.3f} ms)"
        )
        if peer_ms:
            speed = min(peer_ms[r["imbalance"]] / r["solve_ms"] for r in quota)
            out.append(
                f"quota >= 20x faster than the peer: {mark(speed >= 20)} (least {speed:.1f}x)"
            )
    else:
        out.append("quota targets: not measured (policy quota is not registered)")
    peer_row = next((r for r in drift if r["policy"] == "peer"), None)
    if peer_row:
        for r in drift:
            if r["policy"] != "peer":
                ratio = r["bytes"] / peer_row["bytes"]
                slots = r["slots"] / peer_row["slots"]
                out.append(
                    f"drift traffic <= 1/4 of the peer's re-plans, {r['policy']}: "
                    f"{mark(ratio <= 0.25)} ({ratio:.3f} of the peer's bytes, "
                    f"{slots:.3f} of its changed slots)"
                )
    else:
        out.append("drift target: not measured (peer unavailable)")
    return out


def markdown(tables: list[Rendered], verdicts: list[str]) -> str:
    parts = []
    for title, head, body in tables:
        parts.append(f"**{title}**\n")
        parts.append("| " + " | ".join(head) + " |")
        parts.append("|" + "---|" * len(head))
        parts.extend("| " + " | ".join(row) + " |" for row in body)
        parts.append("")
    parts.append("Targets:\n")
    parts.extend(f"- {v}" for v in verdicts)
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.exit(main())
