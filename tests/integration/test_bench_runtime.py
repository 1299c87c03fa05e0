"""The SPMD runtime benchmarks run end to end at a tiny scale: their reports have every
row, and the ratios they print are computed from the numbers they measured."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.integration


def _run(repo, tmp_path, script: str, *extra: str) -> dict:
    out = tmp_path / f"{script}.json"
    cmd = [sys.executable, str(repo / "bench" / script), "--quick", "--json", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict = json.loads(out.read_text())
    assert result["markdown"] in proc.stdout
    assert len(result["load_avg"]) == 2
    return result


def test_bench_runtime_quick(repo, tmp_path, capsys):
    traces = tmp_path / "traces"
    result = _run(repo, tmp_path, "bench_runtime.py", "--trace-dir", str(traces))
    (group,) = result["groups"]
    rows = {r["policy"]: r for r in group["rows"]}
    assert set(rows) == {"static", "hybrid"} and group["gbps"] == 0.02
    static = rows["static"]
    for r in rows.values():
        assert r["backend"] == "gloo" and not r["errors"]
        # medians from the first step on a plan the controller made (never step 0: fresh
        # workers); the quick run's 4 steps all run on the first plan
        k = r["measured_from"]
        assert k == 1
        assert r["median_seconds"] == pytest.approx(statistics.median(r["seconds"][k:]))
        assert r["speedup_vs_static"] == pytest.approx(
            statistics.median(static["seconds"][k:]) / r["median_seconds"]
        )
        assert r["predicted_seconds"] == pytest.approx(statistics.median(r["predicted"][k:]))
        assert r["predicted_over_measured"] == pytest.approx(
            r["predicted_seconds"] / r["median_seconds"]
        )
        assert 0 <= r["ray_fraction"] < 1 and 0 <= r["outside_fraction"] < 1
        assert all(p > 0 for p in r["predicted"])
    (cal,) = result["calibrations"]
    assert cal["collectives"] > 0 and cal["full_median"] > 0 and cal["small_median"] > 0
    # one calibration run of each batch size before the group and one after, pooled
    assert len(cal["full_medians"]) == 2 and len(cal["small_medians"]) == 2
    assert min(cal["full_medians"]) <= cal["full_median"] <= max(cal["full_medians"])
    assert group["calibration"] == "cal-2dc-20mbps.yaml"
    # a full-batch probe between the two rows: each row's constants are the group's times
    # the drift of the probes on either side of it (before, probe, after)
    assert len(cal["probe_medians"]) == 3
    for r in rows.values():
        assert r["calibration"] == f"cal-2dc-20mbps-{r['policy']}.yaml"
        scaled = yaml.safe_load((traces / r["calibration"]).read_text())
        assert scaled["seconds_per_token"] == pytest.approx(
            cal["seconds_per_token"] * r["drift_factor"]
        )
        assert scaled["collective_seconds"] == pytest.approx(
            cal["collective_seconds"] * r["drift_factor"]
        )
    # each row's prediction is `expertmesh sim replay` of the trace its runtime wrote
    from expertmesh.cli.main import main

    row = traces / "2dc-20mbps-hybrid"
    assert rows["hybrid"]["trace_dir"] == str(row)
    args = ["sim", "replay", "--trace", str(row / "trace.npz"), "--plan", str(row / "plans.npz"),
            "--calibration", str(traces / rows["hybrid"]["calibration"])]  # fmt: skip
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"predicted median step {rows['hybrid']['predicted_seconds']:.4g} s" in out
    assert f"measured {rows['hybrid']['median_seconds']:.4g} s" in out
    # the trace holds each rank's CPU and shaper waits per step
    from expertmesh.formats import read_trace

    meta = read_trace(row / "trace.npz").meta
    assert len(meta["rank_cpu_seconds"]) == len(rows["hybrid"]["seconds"])
    assert all(len(x) == 4 and min(x) > 0 for x in meta["rank_cpu_seconds"])
    assert len(meta["rank_shaped_seconds"]) == len(rows["hybrid"]["seconds"])
    # --repredict: the same predictions from the saved traces alone (calibration runs,
    # probes, rows), without running the runtime
    again = tmp_path / "again.json"
    cmd = [sys.executable, str(repo / "bench" / "bench_runtime.py"), "--repredict",
           str(tmp_path / "bench_runtime.py.json"), "--json", str(again)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (regroup,) = json.loads(again.read_text())["groups"]
    for a, b in zip(group["rows"], regroup["rows"], strict=True):
        assert b["predicted"] == pytest.approx(a["predicted"], rel=1e-12)
        assert b["drift_factor"] == pytest.approx(a["drift_factor"], rel=1e-12)
        assert b["median_seconds"] == a["median_seconds"]
    # the removed old plane: its recorded rows, named as such, not a re-run
    assert {o["dcs"] for o in result["old_plane"]} == {2, 3}
    assert all(len(o["commit"]) == 40 for o in result["old_plane"])
    assert "not re-run" in result["markdown"]


def test_bench_balance_train_quick(repo, tmp_path):
    result = _run(repo, tmp_path, "bench_balance_train.py")
    rows = {r["mode"]: r for r in result["balance"]}
    assert set(rows) == {
        "hybrid + fast loop",
        "hybrid + fast loop, sizes exchanged",
        "hybrid + fast loop, route's DCs",
        "hybrid, slow loop only",
        "static",
    }
    for r in rows.values():
        assert r["median_max_over_mean"] == pytest.approx(statistics.median(r["per_microbatch"]))
        assert r["median_max_over_mean"] >= r["median_floor"] - 1e-9 >= 1.0 - 1e-9
    assert rows["static"]["median_replicas"] == 0  # no fast loop, no replicas
    assert all(r["median_token_mb"] >= 0 for r in rows.values())
    links = result["links"]
    assert {(r["microbatches"], r["mode"]) for r in links} == {
        (2, m) for m in ("static", "hybrid + fast loop")
    }
    for r in links:
        assert r["median_seconds"] == pytest.approx(statistics.median(r["seconds"][1:]))
        assert r["predicted_over_measured"] == pytest.approx(
            statistics.median(r["predicted"][1:]) / r["median_seconds"]
        )
