"""bench_balance_cores.py end to end at a tiny scale: every row, the workers on the CPUs
asked for, the force-balanced ideal exactly balanced by its forced router through the
real runtime, and the ratios it prints computed from the numbers it measured."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

MODES = {
    "static", "static + fast loop", "hybrid, slow loop only", "hybrid + fast loop",
    "quota, slow loop only", "force-balanced ideal",
}  # fmt: skip


def test_bench_balance_cores_quick(repo, tmp_path):
    out = tmp_path / "cores.json"
    pin = len(os.sched_getaffinity(0)) >= 2
    cmd = [sys.executable, str(repo / "bench" / "bench_balance_cores.py"), "--quick",
           "--json", str(out), *([] if pin else ["--no-pin"])]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["markdown"] in proc.stdout
    if pin:  # the workers said they run there (the bench stops otherwise)
        cpus = sorted(os.sched_getaffinity(0))[:2]
        assert result["worker_cpus"] == [[c] for c in cpus]
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == MODES
    ideal, static = rows["force-balanced ideal"], rows["static"]
    assert all(x == pytest.approx(1.0) for x in ideal["max_over_mean"])  # every step
    for mode in ("static + fast loop", "hybrid + fast loop"):
        assert rows[mode]["median_replicas"] > 0  # the fast loop ran
        assert rows[mode]["median_max_over_mean"] < static["median_max_over_mean"]
    for r in rows.values():
        used = [r["seconds"][s] for s in r["steps_used"]]
        assert r["median_seconds"] == pytest.approx(statistics.median(used))
        assert r["speedup_vs_static"] == pytest.approx(
            static["median_seconds"] / r["median_seconds"]
        )
        assert r["ideal_over_row"] == pytest.approx(ideal["median_seconds"] / r["median_seconds"])
        assert 0 < r["median_forward_backward"] < r["median_seconds"]
        if r["mode"] in (
            "static",
            "hybrid, slow loop only",
            "quota, slow loop only",
            "force-balanced ideal",
        ):
            assert r["median_replicas"] == 0 and r["median_balance_seconds"] == 0
