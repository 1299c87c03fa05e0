"""docs/results.md's section "The simulator against the runtime", from a recorded run.

The runtime cannot run inside ``make results`` (it needs the machine quiet for minutes, and
Ray), so the section is written from the JSON of one ``make bench-runtime`` run committed
as ``docs/results/bench-runtime.json`` (``bench/bench_runtime.py --json``: every row's
measured steps, its replay's predicted ones, the calibration of its group, the commit and
load it ran at). Each row says whether the prediction holds (within 15% of the measured
median step) with its ratio. Without the file the section says where the table lives.
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime_tables import fmt_gbps

TOLERANCE = 0.15  # issue 13, item 8: the predicted median step within 15% of the measured
RECORD = "docs/results/bench-runtime.json"
GRID = [(d, g) for d in (2, 3) for g in (1.0, 0.1, 0.02)]  # make bench-runtime's groups


def section(root: Path) -> list[str]:
    """The section's lines (markdown)."""
    path = root / RECORD
    lines = [
        "## The simulator against the runtime",
        "",
        "The step model of the SPMD data plane (`expertmesh sim replay` of the trace.npz and",
        "plans.npz each runtime writes: the collectives of the plan every step ran on, the",
        "bytes of every collective that crossed DCs as the workers counted them, the",
        "copies of experts each rank held, the constants calibrated over free links just",
        "before and after each group (static at two batch sizes and the replicated layout",
        "that holds every expert in every DC), scaled per row by the drift of a static",
        "probe run on either side of the row)",
        "against the measured median step of every row of `make bench-runtime` (the demo",
        "model on the SPMD plane over gloo, 2 and 3 DCs, 1 Gbit/s to 20 Mbit/s, 20 ms).",
        "Medians over the steps that ran on a plan the controller made (steps 6-15 of 16;",
        "before them every row runs the initial placement); the ratio over steps 1-15 is",
        "beside it.",
    ]
    if not path.exists():
        return [*lines, "", f"(No recorded run: `{RECORD}` is missing.)", ""]
    run = json.loads(path.read_text())
    rows = [(g, r) for g in run["groups"] for r in g["rows"]]
    held = [abs(r["predicted_over_measured"] - 1) <= TOLERANCE for _, r in rows]
    ratios = [r["predicted_over_measured"] for _, r in rows]
    lines += [
        "",
        *_provenance(run),
        "",
        f"**Prediction within 15% of the measured median step: {sum(held)} of {len(rows)} "
        f"rows** (predicted / measured {min(ratios):.2f}-{max(ratios):.2f}; a row holds when "
        "the unrounded ratio is within 0.85-1.15).",
        "",
        "| DCs | inter-DC | policy | measured s/step | predicted s/step | predicted / measured "
        "| within 15% | drift factor | predicted / measured, steps 1-15 |",
        "|---|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for (g, r), ok in zip(rows, held, strict=True):
        lines.append(
            f"| {g['dcs']} | {fmt_gbps(g['gbps'])} | {r['policy']} | {r['median_seconds']:.3f} "
            f"| {r['predicted_seconds']:.3f} | {r['predicted_over_measured']:.3f} "
            f"| {'holds' if ok else 'does not hold'} | {r.get('drift_factor', 1.0):.2f} "
            f"| {r.get('predicted_all_over_measured', r['predicted_over_measured']):.3f} |"
        )
    return [*lines, "", *_misses(run), ""]


def _misses(run: dict) -> list[str]:
    """For each row that does not hold: its ratio and the drift of the probes beside it
    (the factor its constants were scaled by, and the probes' medians against the
    group's full-batch one), what a reader checks first."""
    cals = {(c["dcs"], c["gbps"]): c for c in run.get("calibrations", [])}
    out = []
    for g in run["groups"]:
        cal = cals.get((g["dcs"], g["gbps"]), {})
        probes = cal.get("probe_medians") or []
        for i, r in enumerate(g["rows"]):
            if abs(r["predicted_over_measured"] - 1) <= TOLERANCE:
                continue
            beside = probes[i : i + 2]
            why = (
                f"; the probes beside it {', '.join(f'{m:.3f}' for m in beside)} s against the "
                f"group's full-batch median {cal['full_median']:.3f} s"
                if len(beside) == 2 and "full_median" in cal
                else ""
            )
            out.append(
                f"- Does not hold: {r['policy']}, {g['dcs']} DCs, {fmt_gbps(g['gbps'])}: "
                f"{r['predicted_over_measured']:.3f}, drift factor "
                f"{r.get('drift_factor', 1.0):.2f}{why} (docs/benchmarks.md, Runtime, says why)."
            )
    return out


def _checks(run: dict) -> list[str]:
    """The calibration check (bench/spmdbench.py ``check_calibration``, on each group's
    calibration runs alone): which groups of the table it flags, and the attempts a run
    rejected and ran again."""
    cals = run.get("calibrations") or []
    checked = [c for c in cals if c.get("check")]
    if not checked:
        return []
    bad = [c for c in checked if c["check"]["faults"]]
    out = [
        f"Calibration check (the full batch's median step at least "
        f"{checked[0]['check']['min_batch_ratio']:g}x the quarter batch's before, after and "
        f"pooled; a batch size's before and after runs within "
        f"{checked[0]['check']['max_drift']:g}x): "
        + (
            f"passes in all {len(checked)} groups of the table."
            if not bad
            else f"fails in {len(bad)} of {len(checked)} groups of the table."
        )
    ]
    for c in bad:
        out.append(
            f"**Calibration flagged**: {c['dcs']} DCs {fmt_gbps(c['gbps'])}: "
            f"{'; '.join(c['check']['faults'])}."
        )
    for r in run.get("rejected") or []:
        out.append(
            f"Rejected and run again: {r['dcs']} DCs {fmt_gbps(r['gbps'])}, attempt "
            f"{r['attempt']}: {'; '.join(r['faults'])} (its rows in the record, not the table)."
        )
    return out


def _provenance(run: dict) -> list[str]:
    """Which run (or runs: ``parts``, groups measured in separate runs) recorded the
    rows, at which commit and load; a re-prediction's commit."""
    parts = run.get("parts") or [run]
    out = []
    for part in parts:
        rec = part.get("record", {})
        groups = part.get("groups") or []
        which = (
            " (groups: " + ", ".join(f"{g[0]} DCs {fmt_gbps(g[1])}" for g in groups) + ")"
            if run.get("parts")
            else ""
        )
        out.append(
            f"Recorded by `{rec.get('command', 'make bench-runtime')}`{which} at commit "
            f"{rec.get('commit', '?')[:7]}, {rec.get('started_utc', '?')} UTC, "
            f"{part['seconds']:.0f} s; load average (1 min, 2 cores) "
            f"{part['load_avg'][0][0]:.2f} at the start, {part['load_avg'][1][0]:.2f} at the end."
        )
        if part.get("stopped"):
            out.append(f"**Partial run**: {part['stopped']}.")
        if part.get("repredicted") and not run.get("repredicted"):  # (a part, not the run)
            out.append(
                "Its rows predicted again from its traces at commit "
                f"{part['repredicted']['commit'][:7]}."
            )
    if run.get("repredicted"):
        out.append(
            "Predicted again from the recorded traces (`bench_runtime.py --repredict`) at "
            f"commit {run['repredicted']['commit'][:7]}: the measurements are the runs', the "
            "constants and predictions the current model's."
        )
    have = {(g["dcs"], g["gbps"]) for g in run["groups"]}
    missing = [f"{d} DCs {fmt_gbps(b)}" for d, b in GRID if (d, b) not in have]
    if missing:
        out.append(
            f"**Not in this record** (not measured by its runs): {', '.join(missing)} "
            f"({len(missing) * 5} of {len(GRID) * 5} rows of `make bench-runtime`)."
        )
    for f in run.get("failed") or []:
        out.append(f"**Failed group**: {f['dcs']} DCs {fmt_gbps(f['gbps'])}: {f['error']}.")
    out += _checks(run)
    out.append(f"(`{RECORD}`; docs/benchmarks.md, Runtime, has every column and the analysis).")
    return out
