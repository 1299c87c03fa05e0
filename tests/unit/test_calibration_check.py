"""The calibration check of bench-runtime (``spmdbench.check_calibration``): a group's
calibration is judged on its own runs (full batch clearly slower than the quarter batch,
before and after runs that agree), and a live run re-runs a group whose calibration
fails, keeping every attempt (``bench_runtime._checked_group``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_runtime
import spmdbench
from spmdbench import calibration_faults

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "docs" / "results" / "bench-runtime-runs"


def test_a_healthy_calibration_passes() -> None:
    # br-e's 2 DCs 20 Mbit/s: full 1.37x and 1.49x the quarter batch, 1.13x drift
    assert calibration_faults([0.185, 0.208], [0.135, 0.140], 0.196, 0.135) == []


@pytest.mark.parametrize("quarter", [0.2, 0.21, 0.19])
def test_a_full_batch_no_slower_than_the_quarter_is_flagged(quarter: float) -> None:
    faults = calibration_faults([0.2, 0.2], [quarter, quarter], 0.2, quarter)
    assert len(faults) == 3  # before, after, pooled
    assert all("quarter batch" in f for f in faults)


def test_one_side_or_the_pool_alone_is_flagged() -> None:
    (fault,) = calibration_faults([0.149, 0.17], [0.158, 0.12], 0.16, 0.13)
    assert fault.startswith("before: full batch 0.149 s is 0.943x")
    (fault,) = calibration_faults([0.30, 0.30], [0.20, 0.20], 0.22, 0.20)
    assert fault.startswith("pooled:")


def test_before_and_after_that_disagree_are_flagged() -> None:
    (fault,) = calibration_faults([0.20, 0.30], [0.12, 0.15], 0.25, 0.13)
    assert fault == "full batch before 0.200 s, after 0.300 s: 1.500x apart (> 1.4x)"
    (fault,) = calibration_faults([0.30, 0.30], [0.10, 0.15], 0.30, 0.12)
    assert fault.startswith("quarter batch before 0.100 s")
    # within the tolerance: passes
    assert calibration_faults([0.20, 0.27], [0.10, 0.13], 0.25, 0.12) == []


def test_the_recorded_groups_it_flags() -> None:
    """Over every committed record: br-a's and br-f's 2 DCs 1 Gbit/s are flagged (the two
    calibrations known bad), the five groups of br-b..br-e pass."""
    flagged, passed = set(), set()
    for path in sorted(RUNS.glob("br-[a-f].json")):
        for c in json.loads(path.read_text())["calibrations"]:
            faults = calibration_faults(
                c["full_medians"], c["small_medians"], c["full_median"], c["small_median"]
            )
            (flagged if faults else passed).add((path.stem, c["dcs"], c["gbps"]))
    assert flagged == {("br-a", 2, 1.0), ("br-f", 2, 1.0)}
    assert len(passed) == 5


def test_check_from_the_traces_as_repredict_runs_it() -> None:
    """From the calibration runs' traces alone (what --repredict reads)."""
    for name, ok in (("br-f", False), ("br-e", True)):
        root = RUNS / name
        rec = json.loads((RUNS / f"{name}.json").read_text())
        runs = rec["calibrations"][0]["runs"]
        before, after = [root / r for r in runs["before"]], [root / r for r in runs["after"]]
        cal = spmdbench.calibrate([before[0], after[0]], [before[1], after[1]])
        check = spmdbench.check_calibration(before, after, cal)
        assert check["passed"] is ok and bool(check["faults"]) is not ok


def _attempts(
    monkeypatch: pytest.MonkeyPatch, verdicts: list[list[str]], check: bool = True
) -> dict:
    """``_checked_group`` with each attempt's check faults given, no runtime started."""
    calls: list[int] = []

    def fake(args, dcs, gbps, lm, small, labels, before, cal_runs, probe, attempt=0):  # type: ignore[no-untyped-def]
        calls.append(attempt)
        info = {"dcs": dcs, "gbps": gbps, "check": {"faults": verdicts[attempt]}}
        group = {"dcs": dcs, "gbps": gbps, "rows": [{"policy": "static"}], "attempt": attempt}
        return group, info, ("after", attempt)

    monkeypatch.setattr(bench_runtime, "_group_and_calibration", fake)
    args = argparse.Namespace(json=None, calibration_check=check, calibration_attempts=3)
    out: dict[str, Any] = {"groups": [], "calibrations": [], "failed": []}
    made: list[int] = []

    def cal_runs() -> Any:
        made.append(1)
        return ("before", len(made))

    nxt = bench_runtime._checked_group(
        out,
        args,
        2,
        1.0,
        None,
        None,
        ["static"],
        None,
        cal_runs,
        lambda p: None,  # type: ignore[arg-type]
    )
    return {"out": out, "next": nxt, "calls": calls, "before_runs": len(made)}


def test_a_rejected_attempt_is_kept_and_the_group_run_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    got = _attempts(monkeypatch, [["pooled: bad"], []])
    out = got["out"]
    assert got["calls"] == [0, 1] and got["before_runs"] == 2  # calibrated afresh
    (group,) = out["groups"]
    assert group["attempt"] == 1 and got["next"] == ("after", 1)
    (rej,) = out["rejected"]
    assert rej["attempt"] == 1 and rej["faults"] == ["pooled: bad"] and rej["group"]["rows"]
    assert out["failed"] == []


def test_no_attempt_passing_is_a_failed_calibration_not_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    got = _attempts(monkeypatch, [["a"], ["b"], ["c"]])
    out = got["out"]
    assert got["calls"] == [0, 1, 2] and got["next"] is None
    assert out["groups"] == [] and out["calibrations"] == []
    assert [r["faults"] for r in out["rejected"]] == [["a"], ["b"], ["c"]]
    (failed,) = out["failed"]
    assert failed["calibration_failed"] and "all 3 attempts" in failed["error"]


def test_the_check_off_keeps_the_first_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    got = _attempts(monkeypatch, [["a"], []], check=False)
    out = got["out"]
    assert got["calls"] == [0] and got["next"] == ("after", 0)
    assert len(out["groups"]) == 1 and "rejected" not in out
    assert out["calibrations"][0]["check"]["faults"] == ["a"]  # recorded all the same


def test_results_name_the_flagged_groups_and_rejected_attempts(tmp_path: Path) -> None:
    import results_runtime

    row = {"policy": "hybrid", "median_seconds": 0.2, "predicted_seconds": 0.2}
    check = {"min_batch_ratio": 1.15, "max_drift": 1.4}
    run = {
        "groups": [{"dcs": 2, "gbps": g, "rows": [{**row, "predicted_over_measured": 1.0}]}
                   for g in (1.0, 0.1)],
        "calibrations": [
            {"dcs": 2, "gbps": 1.0, "check": {**check, "faults": ["pooled: 1.06x"]}},
            {"dcs": 2, "gbps": 0.1, "check": {**check, "faults": []}},
        ],
        "rejected": [{"dcs": 2, "gbps": 0.1, "attempt": 1, "faults": ["after: 1.11x"]}],
        "seconds": 1.0,
        "load_avg": [[1.0], [1.0]],
    }  # fmt: skip
    (tmp_path / results_runtime.RECORD).parent.mkdir(parents=True)
    (tmp_path / results_runtime.RECORD).write_text(json.dumps(run))
    text = "\n".join(results_runtime.section(tmp_path))
    assert "fails in 1 of 2 groups of the table" in text
    assert "**Calibration flagged**: 2 DCs 1 Gbit/s: pooled: 1.06x." in text
    assert "Rejected and run again: 2 DCs 100 Mbit/s, attempt 1: after: 1.11x" in text
