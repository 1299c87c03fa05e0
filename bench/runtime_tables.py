"""The tables ``bench/bench_runtime.py`` prints and keeps (``markdown`` in its JSON): every
row with its prediction, each row's replay by part, where the measured time went, Ray and
driver overhead beside the old plane's, and the calibrations. Pure formatting of a
result dict; docs/benchmarks.md, "Runtime", reads them."""

from __future__ import annotations

from typing import Any

__all__ = ["fmt_gbps", "line", "markdown"]


def fmt_gbps(g: float) -> str:
    return f"{g:g} Gbit/s" if g >= 1 else f"{g * 1000:g} Mbit/s"


def line(r: dict[str, Any]) -> str:
    return (
        f"{r['policy']:11s} median {r['median_seconds']:.3f}s "
        f"x{r.get('speedup_vs_static', 1.0):.2f} vs static, predicted "
        f"{r['predicted_seconds']:.3f}s ({r['predicted_over_measured']:.2f}; steps "
        f"{r['measured_from']}-, drift x{r['drift_factor']:.2f}); Ray "
        f"{r['ray_fraction']:.1%}, outside training {r['outside_fraction']:.1%}, driver "
        f"{r['driver_fraction']:.1%} (CPU {r['driver_cpu_fraction']:.1%}); "
        f"{r['tokens_per_second_per_worker']:.0f} tok/s/worker; collectives "
        f"{r['measured_collectives']:g} (model {r['model_collectives']:g}), shaper waits "
        f"{r['measured_shaped_seconds']:.3f}s (model latency + transfer "
        f"{r['predicted_parts']['latency'] + r['predicted_parts']['transfer']:.3f}s)"
    )


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| DCs | inter-DC | policy | median s/step | vs static | predicted s | pred / meas "
        "| tokens/s/worker | Ray % | outside training % | driver % | WAN tokens MB/step "
        "| WAN weights MB/step | migration MB/run | max loss diff vs static |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for g in result["groups"]:
        for r in g["rows"]:
            bad = abs(r["predicted_over_measured"] - 1) > 0.15
            ratio = f"{r['predicted_over_measured']:.2f}"
            lines.append(
                f"| {g['dcs']} | {fmt_gbps(g['gbps'])} | {r['policy']} "
                f"| {r['median_seconds']:.3f} | {r.get('speedup_vs_static', 1.0):.2f}x "
                f"| {r['predicted_seconds']:.3f} | {f'**{ratio}**' if bad else ratio} "
                f"| {r['tokens_per_second_per_worker']:.0f} | {100 * r['ray_fraction']:.1f} "
                f"| {100 * r['outside_fraction']:.1f} | {100 * r['driver_fraction']:.1f} "
                f"| {r['token_mb_per_step']:.2f} "
                f"| {r['weight_mb_per_step']:.2f} | {r['migration_mb_per_run']:.2f} "
                f"| {r.get('loss_rel_diff_vs_static', 0.0):.1e} |"
            )
    lines += _replay_table(result)
    lines += _split_table(result)
    lines += _overhead_table(result)
    lines += [
        "",
        "Calibration (static, free links, one run per batch size just before and one just "
        "after each group, their steps pooled; a full-batch probe between each two rows, "
        "their medians in order before, probes, after):",
        "",
    ]
    lines += [
        f"- {c['dcs']} DCs, {fmt_gbps(c['gbps'])}: median step {c['full_median']:.3f} s "
        f"(full batch; {c['full_medians'][0]:.3f} before, {c['full_medians'][1]:.3f} after), "
        f"{c['small_median']:.3f} s (quarter; {c['small_medians'][0]:.3f}, "
        f"{c['small_medians'][1]:.3f}) -> a = {c['seconds_per_token'] * 1e6:.1f} "
        f"us per token, c = {c['collective_seconds'] * 1e3:.2f} ms per collective "
        f"({c['collectives']} per static step), h = {c.get('copy_seconds', 0.0) * 1e3:.2f} ms "
        f"per copy ({c.get('copies', 0.0):g} per rank static; replicated layout "
        + ", ".join(f"{m:.3f}" for m in c.get("replicated_medians", []))
        + f" s, {c.get('replicated_collectives', 0)} collectives, "
        f"{c.get('replicated_copies', 0.0):g} copies; load {c['load']:.1f}); probes "
        + ", ".join(f"{m:.3f}" for m in c["probe_medians"])
        + _check_words(c.get("check"))
        for c in result["calibrations"]
    ]
    for r in result.get("rejected") or []:
        lines.append(
            f"- rejected: {r['dcs']} DCs, {fmt_gbps(r['gbps'])}, attempt {r['attempt']} (its "
            f"calibration failed the check: {'; '.join(r['faults'])}; rows kept in the JSON "
            "under `rejected`)"
        )
    return "\n".join(lines) + "\n"


def _check_words(check: dict[str, Any] | None) -> str:
    """The calibration check's verdict (spmdbench.check_calibration), if recorded."""
    if not check:
        return ""
    when = f", attempt {check['attempt']}" if "attempt" in check else ""
    if not check["faults"]:
        return f"; check: passes{when}"
    return f"; **check: fails**{when} ({'; '.join(check['faults'])})"


def _replay_table(result: dict[str, Any]) -> list[str]:
    """Each row's replay: the model's parts and counts beside what the workers counted."""
    lines = [
        "",
        "Replay (`expertmesh sim replay` of each row's trace; medians over the measured steps):",
        "",
        "| DCs | inter-DC | policy | measured s | predicted s | pred / meas | drift "
        "| pred / meas, steps 1- | compute s "
        "| collectives s | copies s | latency s | transfer s | collectives (model / workers) "
        "| crossing (model) | copies per rank | shaper waits s (workers) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for g in result["groups"]:
        for r in g["rows"]:
            q = r["predicted_parts"]
            lines.append(
                f"| {g['dcs']} | {fmt_gbps(g['gbps'])} | {r['policy']} | {r['median_seconds']:.3f} "
                f"| {r['predicted_seconds']:.3f} | {r['predicted_over_measured']:.2f} "
                f"| {r['drift_factor']:.2f} | {r['predicted_all_over_measured']:.2f} "
                f"| {q['compute']:.3f} | {q['software']:.3f} | {q.get('copies', 0.0):.3f} "
                f"| {q['latency']:.3f} | {q['transfer']:.3f} | {r['model_collectives']:g} / "
                f"{r['measured_collectives']:g} | {r['model_crossing']:g} "
                f"| {r.get('model_copies', 0.0):g} | {r['measured_shaped_seconds']:.3f} |"
            )
    return lines


def _split_table(result: dict[str, Any]) -> list[str]:
    """Each row's measured step beside what its trace says the time went to, and the
    model's two halves (medians over the measured steps)."""
    rows = [(g, r) for g in result["groups"] for r in g["rows"] if "cpu_over_cores_seconds" in r]
    if not rows:
        return []
    lines = [
        "",
        "Where the time went (the traces' per-rank counters: the ranks' CPU seconds summed "
        "over the machine's cores, the longest total sleep in the link shaper of any rank; "
        "rest = measured - both; the model's CPU part = compute + collectives + copies, its "
        "link part = latency + transfer):",
        "",
        "| DCs | inter-DC | policy | measured s | ranks' CPU / cores s | longest shaper sleep s "
        "| rest s | model CPU part s | model link part s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for g, r in rows:
        q = r["predicted_parts"]
        cpu, sleep = r["cpu_over_cores_seconds"], r["longest_sleep_seconds"]
        lines.append(
            f"| {g['dcs']} | {fmt_gbps(g['gbps'])} | {r['policy']} | {r['median_seconds']:.3f} "
            f"| {cpu:.3f} | {sleep:.3f} | {r['median_seconds'] - cpu - sleep:.3f} "
            f"| {q['compute'] + q['software'] + q.get('copies', 0.0):.3f} "
            f"| {q['latency'] + q['transfer']:.3f} |"
        )
    return lines


def _overhead_table(result: dict[str, Any]) -> list[str]:
    """Driver and Ray overhead per step, the SPMD plane beside the old one (static)."""
    if not result["groups"]:
        return []
    first = result["groups"][0]["gbps"]
    lines = [
        "",
        f"Driver and Ray overhead per step, static at {fmt_gbps(first)} (the old plane: "
        "recorded, not re-run; oldplane_record.json names its commit and command):",
        "",
        "| plane | DCs | median s/step (end to end) | Ray + driver % of step (measured) "
        "| driver CPU % of wall | Ray rounds/step | modeled Ray rounds % |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for g in result["groups"]:
        r = next((r for r in g["rows"] if r["policy"] == "static"), None)
        if g["gbps"] != first or r is None:
            continue
        lines.append(
            f"| SPMD | {g['dcs']} | {r['median_seconds']:.3f} "
            f"| {100 * (r['ray_fraction'] + r['driver_fraction']):.1f} "
            f"| {100 * r['driver_cpu_fraction']:.1f} | 0 | - |"
        )
    for o in result["old_plane"]:
        lines.append(
            f"| old (Ray rounds, at {o['commit'][:7]}) | {o['dcs']} | {o['median_seconds']:.3f} "
            f"| {100 * o['measured_overhead_fraction']:.1f} "
            f"| {100 * o['driver_cpu_fraction']:.1f} | {o['rounds_per_step']:g} "
            f"| {100 * o['ray_fraction']:.0f} |"
        )
    return lines
