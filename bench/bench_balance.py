"""Per-microbatch balancing benchmark (issue 12 items 3 and 4): quota inside one domain.

1. Solve time per layer: a domain of R = 8, 16, 64 ranks, 4 masters + 2 spare slots per
   rank, 4R experts, top-8, 8192 tokens per rank (EP64 at R = 64), load from the trace
   generator at static max/mean 1.5, 2.0 and 3.0 (where top-8 over 4R experts can reach
   it), seeds 0..2. Contenders, on the same load: ``quota_balance`` (the planner's solve
   with its route, what ``expertmesh plan`` runs per layer), ``fastquota.balance_domain``
   (numpy) and ``quota_torch.balance_torch`` (torch on CPU), each to replicas and the
   full token split, exact settings (all three give the same T, replicas and split).
2. Replica economy at R = 64 and 8: replicas made, max/mean, replica weights fanned out
   per microbatch, and straggler compute saved against ``quota`` exact, for a grid of
   ``tolerance`` and ``min_replica_share``.

One thread (BLAS/OpenMP and torch), process CPU time, median of ``--repeats`` solves per
load, median over loads. Ratios are against ``quota_balance`` measured in the same run.

    make bench-balance      # or: python bench/bench_balance.py [--quick] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
for _root in ("controller", "workers", "proto"):
    if str(REPO / _root) not in sys.path:
        sys.path.insert(0, str(REPO / _root))

from expertmesh.planner import ModelSpec  # noqa: E402 (after the source roots are on sys.path)
from expertmesh.planner.costmodel import CostSettings  # noqa: E402
from expertmesh.planner.fastquota import (  # noqa: E402
    DEFAULTS,
    EXACT,
    BalanceSettings,
    balance_domain,
    replica_min_tokens,
)
from expertmesh.planner.quota import quota_balance  # noqa: E402
from expertmesh.planner.static import static_placement  # noqa: E402
from expertmesh.planner.topology import Link  # noqa: E402
from expertmesh.planner.trace import TraceSettings, generate_trace  # noqa: E402

SIZES = (8, 16, 64)
IMBALANCES = (1.5, 2.0, 3.0)
MASTERS, SPARE, TOP_K, TOKENS_PER_RANK = 4, 2, 8, 8192
TOLERANCES = (0.0, 0.005, 0.01, 0.02, 0.05)
SHARES = (0.0, 0.005, 0.01, 0.02, 0.05)
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
MALLOC_VARS = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(512 << 20)}

console = Console()
Rendered = tuple[str, list[str], list[list[str]]]


def loads(num_ranks: int, seeds: int) -> list[tuple[float, np.ndarray]]:
    """``(static max/mean target, load [R, 4R])`` for every reachable target and seed."""
    out = []
    for target in IMBALANCES:
        for seed in range(seeds):
            settings = TraceSettings(
                num_ranks=num_ranks,
                num_experts=MASTERS * num_ranks,
                num_steps=1,
                top_k=TOP_K,
                tokens_per_rank=TOKENS_PER_RANK,
                imbalance=target,
                seed=seed,
            )
            try:
                out.append((target, generate_trace(settings).load[0, 0]))
            except ValueError:  # out of reach with top-8 over 4R experts
                break
    return out


def median_seconds(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    *,
    clock: Callable[[], float] = time.process_time,
    warmups: int = 1,
) -> dict[str, float]:
    """Median seconds of ``clock`` (process CPU time unless told) of each ``fn()`` after
    ``warmups`` calls; the contenders take turns, so a change in the machine's load falls
    on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(warmups):
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


def speed_rows(seeds: int, repeats: int) -> list[dict[str, Any]]:
    import torch

    from expertmesh.workers.quota_torch import balance_torch

    rows = []
    for num_ranks in SIZES:
        masters = static_placement(num_ranks, MASTERS + SPARE, MASTERS * num_ranks, MASTERS)
        p2l_t = torch.from_numpy(masters.phy2log.astype(np.int64))
        times: dict[str, list[float]] = {"quota": [], "numpy": [], "torch": [], "defaults": []}
        reps, targets = [], set()
        for target, load in loads(num_ranks, seeds):
            targets.add(target)
            load_t = torch.from_numpy(load)
            sol = balance_domain(load, masters.phy2log, EXACT)
            old = quota_balance(load, masters)
            if sol.quota != int(old.quota[0]):  # the same answer, or the figures mean nothing
                raise SystemExit(f"R={num_ranks}: fastquota T {sol.quota} != quota {old.quota}")
            reps.append(sol.replicas.shape[0])
            fns: dict[str, Callable[[], object]] = {
                "quota": partial(quota_balance, load, masters),
                "numpy": partial(balance_domain, load, masters.phy2log, EXACT),
                "torch": partial(balance_torch, load_t, p2l_t, EXACT),
                "defaults": partial(balance_domain, load, masters.phy2log, DEFAULTS),
            }
            for name, sec in median_seconds(fns, repeats).items():
                times[name].append(sec)
        row: dict[str, Any] = {"ranks": num_ranks, "loads": len(reps)}
        row["targets"] = ", ".join(f"{t:.1f}" for t in sorted(targets))
        row["replicas"] = float(np.median(reps))
        row.update({f"{k}_ms": 1e3 * float(np.median(v)) for k, v in times.items()})
        rows.append(row)
    return rows


def economy_rows(seeds: int, model: ModelSpec, cost: CostSettings) -> list[dict[str, float]]:
    """Per size and (tolerance, share): median replicas, max/mean, and per microbatch the
    replica weights sent and the straggler compute saved against exact quota."""
    per_token = model.flops_per_token / cost.flops_per_second
    rows = []
    for num_ranks in (64, 8):
        masters = static_placement(num_ranks, MASTERS + SPARE, MASTERS * num_ranks, MASTERS)
        cases = loads(num_ranks, seeds)
        for tol in TOLERANCES:
            for share in SHARES:
                econ = BalanceSettings(tolerance=tol, min_replica_share=share)
                reps, ratio, lost = [], [], []
                for _, load in cases:
                    exact = balance_domain(load, masters.phy2log, EXACT)
                    sol = balance_domain(load, masters.phy2log, econ)
                    mean = load.sum() / num_ranks
                    reps.append(sol.replicas.shape[0])
                    ratio.append(sol.rank_tokens.max() / mean)
                    lost.append(sol.rank_tokens.max() - exact.rank_tokens.max())
                rows.append(
                    {
                        "ranks": num_ranks,
                        "tolerance": tol,
                        "share": share,
                        "replicas": float(np.median(reps)),
                        "max_mean": float(np.median(ratio)),
                        "worst_max_mean": float(np.max(ratio)),
                        "fanout_gb": float(np.median(reps)) * model.expert_bytes / 1e9,
                        "lost_ms": 1e3 * float(np.median(lost)) * per_token,
                    }
                )
    return rows


def speed_table(rows: list[dict[str, Any]]) -> Rendered:
    head = ["ranks", "loads (targets)", "replicas", "quota_balance ms", "numpy ms", "torch ms",
            "quota / numpy", "quota / torch", "numpy, defaults ms"]  # fmt: skip
    body = [
        [
            f"{r['ranks']}",
            f"{r['loads']} ({r['targets']})",
            f"{r['replicas']:.0f}",
            f"{r['quota_ms']:.3f}",
            f"{r['numpy_ms']:.3f}",
            f"{r['torch_ms']:.3f}",
            f"{r['quota_ms'] / r['numpy_ms']:.1f}x",
            f"{r['quota_ms'] / r['torch_ms']:.1f}x",
            f"{r['defaults_ms']:.3f}",
        ]
        for r in rows
    ]
    return "Quota solve time per layer, one domain (medians, 1 thread)", head, body


def economy_tables(rows: list[dict[str, float]]) -> list[Rendered]:
    """Per size: tolerance down, ``min_replica_share`` across; each cell "replicas,
    max/mean p50 (worst)"; and one line per cell pair of what the replicas cost and save."""
    out = []
    for num_ranks in sorted({int(r["ranks"]) for r in rows}, reverse=True):
        mine = [r for r in rows if r["ranks"] == num_ranks]
        head = ["tolerance \\ min_replica_share", *(f"{x:g}" for x in SHARES)]
        body = []
        for tol in TOLERANCES:
            cells = {r["share"]: r for r in mine if r["tolerance"] == tol}
            body.append(
                [f"{tol:.3f}"]
                + [
                    f"{cells[x]['replicas']:.0f}: {cells[x]['max_mean']:.4f} "
                    f"({cells[x]['worst_max_mean']:.4f})"
                    for x in SHARES
                ]
            )
        title = (
            f"Replica economy, one domain of {num_ranks} ranks: replicas per microbatch: "
            "max/mean p50 (worst) over the loads"
        )
        out.append((title, head, body))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="loads per imbalance (median)")
    ap.add_argument("--repeats", type=int, default=50, help="timed solves per load (median)")
    ap.add_argument("--quick", action="store_true", help="1 seed, 5 repeats")
    ap.add_argument("--markdown", type=Path, help="also write the tables here as markdown")
    ap.add_argument("--json", type=Path, help="also write every row here")
    args = ap.parse_args(argv)
    want = dict.fromkeys(THREAD_VARS, "1") | MALLOC_VARS
    if any(os.environ.get(k) != v for k, v in want.items()):  # re-run: 1 thread, steady heap
        env = {**os.environ, **want}
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)
    import torch

    torch.set_num_threads(1)
    if args.quick:
        args.seeds, args.repeats = 1, 5
    model, cost = ModelSpec(), CostSettings()
    console.print(
        f"one domain of R ranks, {MASTERS}+{SPARE} slots/rank, {MASTERS}R experts, top-{TOP_K}, "
        f"{TOKENS_PER_RANK} tokens/rank; 1 thread; load average {os.getloadavg()[0]:.2f}"
    )
    speed = speed_rows(args.seeds, args.repeats)
    tables = [speed_table(speed)]
    econ = economy_rows(args.seeds, model, cost)
    tables += economy_tables(econ)
    exact = next(r for r in econ if r["ranks"] == 64 and r["tolerance"] == 0 and r["share"] == 0)
    notes = [
        f"64 ranks, exact: {exact['replicas']:.0f} replicas = {exact['fanout_gb']:.1f} GB of "
        f"{model.expert_bytes / 1e6:.0f} MB experts per microbatch and layer (--json: every "
        "cell's weights and straggler ms against exact)",
        f"replica break-even (cost model, training, {model.expert_bytes / 1e6:.0f} MB expert): "
        f"{replica_min_tokens(model, Link(400, 0.01), cost)} tokens on a 400 Gbit/s DC link, "
        f"{replica_min_tokens(model, Link(3200, 0.005), cost)} on 3,200 Gbit/s NVLink",
        f"load average at the end {os.getloadavg()[0]:.2f}",
    ]
    for title, head, body in tables:
        table = Table(title=title)
        for col in head:
            table.add_column(col, justify="right")
        for row in body:
            table.add_row(*row)
        console.print(table)
    for n in notes:
        console.print(n)
    if args.json:
        args.json.write_text(json.dumps({"speed": speed, "economy": econ}, indent=2))
    if args.markdown:
        parts = []
        for title, head, body in tables:
            parts += [f"**{title}**\n", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            parts += ["| " + " | ".join(row) + " |" for row in body] + [""]
        parts += [f"- {n}" for n in notes]
        args.markdown.write_text("\n".join(parts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
