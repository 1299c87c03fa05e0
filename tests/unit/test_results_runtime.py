"""docs/results.md's runtime table (bench/results_runtime.py) from a recorded bench run:
every row says holds or does not with its ratio, the count is of those rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import results_runtime


def _row(policy: str, measured: float, predicted: float) -> dict:
    return {
        "policy": policy,
        "median_seconds": measured,
        "predicted_seconds": predicted,
        "predicted_over_measured": predicted / measured,
    }


def _section_of(run: dict, root: Path) -> str:
    """The runtime section that results_runtime writes for ``run`` recorded under ``root``."""
    path = root / results_runtime.RECORD
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(run))
    return "\n".join(results_runtime.section(root))


def test_each_row_holds_or_not_with_its_ratio(tmp_path: Path) -> None:
    run = {
        "groups": [
            {"dcs": 2, "gbps": 1.0, "rows": [_row("static", 0.4, 0.44), _row("hybrid", 0.2, 0.3)]},
            {"dcs": 3, "gbps": 0.02, "rows": [_row("eplb", 1.0, 0.84)]},
        ],
        "seconds": 500.0,
        "load_avg": [[2.5, 1, 1], [3.25, 1, 1]],
        "record": {"command": "make bench-runtime", "commit": "abcdef0123", "started_utc": "x"},
    }
    text = _section_of(run, tmp_path)
    assert "**Prediction within 15% of the measured median step: 1 of 3 rows**" in text
    assert "| 2 | 1 Gbit/s | static | 0.400 | 0.440 | 1.100 | holds |" in text
    assert "| 2 | 1 Gbit/s | hybrid | 0.200 | 0.300 | 1.500 | does not hold |" in text
    assert "| 3 | 20 Mbit/s | eplb | 1.000 | 0.840 | 0.840 | does not hold |" in text
    assert "abcdef0" in text and "2.50 at the start, 3.25 at the end" in text
    assert "- Does not hold: hybrid, 2 DCs, 1 Gbit/s: 1.500, drift factor 1.00" in text
    assert "- Does not hold: eplb, 3 DCs, 20 Mbit/s: 0.840" in text
    assert "Does not hold: static" not in text


def test_without_a_record_the_section_says_so(tmp_path: Path) -> None:
    text = "\n".join(results_runtime.section(tmp_path))
    assert "## The simulator against the runtime" in text
    assert "is missing" in text
    with pytest.raises(StopIteration):
        next(line for line in text.splitlines() if line.startswith("| "))


def test_rows_of_several_runs_name_each_run_and_the_reprediction(tmp_path: Path) -> None:
    def part(commit: str, groups: list, stopped: str | None = None) -> dict:
        out = {"record": {"command": "python bench/bench_runtime.py --dcs 2", "commit": commit,
                          "started_utc": "t"}, "seconds": 300.0,
               "load_avg": [[1.5, 1, 1], [2.0, 1, 1]], "groups": groups}  # fmt: skip
        return out | ({"stopped": stopped} if stopped else {})

    run = {
        "groups": [
            {"dcs": 2, "gbps": 1.0, "rows": [_row("eplb", 0.4, 0.42)]},
            {"dcs": 3, "gbps": 0.02, "rows": [_row("hybrid", 1.0, 0.8)]},
        ],
        "parts": [part("aaaaaaa1", [[2, 1.0]]), part("bbbbbbb2", [[3, 0.02]], "cut at 00:14")],
        "repredicted": {"commit": "ccccccc3", "root": "x"},
        "failed": [{"dcs": 3, "gbps": 0.1, "error": "RuntimeError('link down')"}],
        "seconds": 600.0,
        "load_avg": [[1.5, 1, 1], [2.0, 1, 1]],
    }
    text = _section_of(run, tmp_path)
    assert "(groups: 2 DCs 1 Gbit/s) at commit aaaaaaa" in text
    assert "(groups: 3 DCs 20 Mbit/s) at commit bbbbbbb" in text
    assert "**Partial run**: cut at 00:14." in text
    assert "commit ccccccc: the measurements are the runs'" in text
    assert "**Failed group**: 3 DCs 100 Mbit/s: RuntimeError('link down')." in text
    assert "**Prediction within 15% of the measured median step: 1 of 2 rows**" in text
    assert (
        "**Not in this record** (not measured by its runs): 2 DCs 100 Mbit/s, "
        "2 DCs 20 Mbit/s, 3 DCs 1 Gbit/s, 3 DCs 100 Mbit/s (20 of 30 rows" in text
    )
    # parts predicted again at different commits (no one commit for the table): each says its own
    del run["repredicted"]
    run["parts"][0]["repredicted"] = {"commit": "ddddddd4", "root": "a"}
    run["parts"][1]["repredicted"] = {"commit": "eeeeeee5", "root": "b"}
    text = _section_of(run, tmp_path / "again")
    assert "Its rows predicted again from its traces at commit ddddddd." in text
    assert "Its rows predicted again from its traces at commit eeeeeee." in text
    assert "the measurements are the runs'" not in text
