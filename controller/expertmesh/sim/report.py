"""What the simulator writes: per-step CSV, markdown summaries and PNG plots."""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from expertmesh.sim.engine import COLUMNS, SimResult

__all__ = [
    "cpu_breakdown",
    "plot_heatmap",
    "plot_speedup",
    "plot_step_times",
    "summary_rows",
    "summary_table",
    "write_steps_csv",
]


def write_steps_csv(result: SimResult, path: Path) -> None:
    """One row per policy and step (:data:`~expertmesh.sim.engine.COLUMNS`)."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for run in result.runs:
            for row in run.rows:
                w.writerow(_fmt(v) for v in row.values())


def _fmt(v: object) -> object:
    return f"{v:.9g}" if isinstance(v, float) else v


def summary_rows(result: SimResult, baseline: str = "static") -> list[dict[str, Any]]:
    """Per policy: totals and means over its steps, and speedup over ``baseline``."""
    out: list[dict[str, Any]] = []
    for run in result.runs:
        if run.skipped is not None:
            out.append({"policy": run.name, "skipped": run.skipped})
            continue
        n = len(run.rows)
        out.append(
            {
                "policy": run.name,
                "steps": n,
                "total_seconds": run.total("seconds"),
                "mean_seconds": run.mean_seconds,
                "median_seconds": run.median_seconds,
                "speedup": result.speedup(run.name, baseline),
                "mean_imbalance": run.total("imbalance") / n if n else math.nan,
                "cross_dc_token_bytes": run.total("cross_dc_token_bytes"),
                "cross_dc_weight_bytes": run.total("cross_dc_weight_bytes"),
                "migration_bytes": run.total("migration_bytes"),
                "solve_seconds": run.total("solve_seconds"),
            }
        )
    return out


def cpu_breakdown(result: SimResult, trace_seconds: float) -> dict[str, Any]:
    """Where a run's CPU went (``cpu.json``): ``trace_seconds`` generating traces, and per
    policy ``solve`` (its solves, the solve column) and ``cost`` (the cost model and the
    simulator's bookkeeping of its steps: the rest of its CPU), and ``cost_parts``: the
    cost model's parts of it (``expertmesh.sim.engine.COST_PARTS``; the rest of ``cost``
    is bookkeeping). The process's CPU beyond
    these is start-up, combining groups and writing."""
    runs = {
        r.name: {
            "solve": round(r.total("solve_seconds"), 6),
            "cost": round(r.cpu_seconds - r.total("solve_seconds"), 6),
            "cost_parts": {k: round(v, 6) for k, v in r.cost_parts.items()},
        }
        for r in result.runs
        if r.skipped is None
    }
    return {"trace": round(trace_seconds, 3), "policies": runs}


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f}"


def summary_table(result: SimResult, baseline: str = "static") -> str:
    """A markdown table of :func:`summary_rows`."""
    lines = [
        f"| policy | mean step (s) | median step (s) | speedup vs {baseline} | mean imbalance "
        "| cross-DC tokens (GB) | cross-DC weights (GB) | migration (GB) | solve (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary_rows(result, baseline):
        if "skipped" in r:
            lines.append(f"| {r['policy']} | skipped: {r['skipped']} |||||||| |")
            continue
        lines.append(
            f"| {r['policy']} | {r['mean_seconds']:.4g} | {r['median_seconds']:.4g} "
            f"| {r['speedup']:.2f}x | {r['mean_imbalance']:.2f} "
            f"| {_gb(r['cross_dc_token_bytes'])} | {_gb(r['cross_dc_weight_bytes'])} "
            f"| {_gb(r['migration_bytes'])} | {r['solve_seconds']:.2f} |"
        )
    return "\n".join(lines)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_step_times(result: SimResult, path: Path, title: str = "") -> None:
    """Modeled step time of every policy over the steps of one run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in result.runs:
        if run.rows:
            ax.plot([r.step for r in run.rows], [r.seconds for r in run.rows], label=run.name)
    ax.set_xlabel("step")
    ax.set_ylabel("modeled step time (s)")
    ax.set_yscale("log")
    ax.set_title(title or "step time per policy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_speedup(
    xs: Sequence[float],
    speedups: Mapping[str, Sequence[float]],
    path: Path,
    *,
    xlabel: str,
    title: str,
    logx: bool = True,
) -> None:
    """Speedup over ``static`` of each policy against ``xs`` (bandwidth or DC count)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, ys in speedups.items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speedup over static (x)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_heatmap(
    rows: Sequence[str],
    cols: Sequence[str],
    values: Sequence[Sequence[float]],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
) -> None:
    """``values[i][j]`` (a speedup) at row label ``rows[i]`` and column label ``cols[j]``, on a
    log colour scale, each cell printed."""
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    v = np.asarray(values, dtype=np.float64)
    fig, ax = plt.subplots(figsize=(1.1 * len(cols) + 2.5, 0.6 * len(rows) + 1.8))
    finite = v[np.isfinite(v) & (v > 0)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (1.0, 2.0)
    im = ax.imshow(v, cmap="viridis", norm=LogNorm(vmin=min(lo, 1.0), vmax=max(hi, 1.01)))
    ax.set_xticks(range(len(cols)), labels=list(cols))
    ax.set_yticks(range(len(rows)), labels=list(rows))
    for i in range(v.shape[0]):
        for j in range(v.shape[1]):
            ax.text(j, i, f"{v[i, j]:.2f}x", ha="center", va="center", color="w", fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="speedup over static (x)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
