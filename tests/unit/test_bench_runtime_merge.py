"""bench_runtime's merge of several run records (``--repredict A.json B.json``) into one
table: groups ordered by DC count then fastest link, and a group in two records refused
(one table holds one run's rows per group)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_runtime


def _record(command: str, *groups: tuple[int, float]) -> dict:
    return {
        "groups": [{"dcs": d, "gbps": g, "rows": [{"policy": "static"}]} for d, g in groups],
        "calibrations": [{"dcs": d, "gbps": g} for d, g in groups],
        "record": {"command": command},
        "seconds": 10.0,
        "load_avg": [[1.0], [2.0]],
    }


def test_groups_of_different_runs_make_one_table() -> None:
    out = bench_runtime.merge([_record("a", (3, 0.02)), _record("b", (2, 0.1), (2, 1.0))])
    assert [(g["dcs"], g["gbps"]) for g in out["groups"]] == [(2, 1.0), (2, 0.1), (3, 0.02)]
    assert [p["record"]["command"] for p in out["parts"]] == ["a", "b"]
    assert out["seconds"] == 20.0


def test_a_group_in_two_records_is_refused() -> None:
    with pytest.raises(ValueError, match="2 DCs 1 Gbit/s is in two records"):
        bench_runtime.merge([_record("old", (2, 1.0)), _record("new", (2, 0.02), (2, 1.0))])


def test_a_reprediction_names_every_record_it_read() -> None:
    a, b = _record("a", (3, 0.02)), _record("b", (2, 0.1))
    a["repredicted"] = {"commit": "c1", "root": "runs/a"}
    b["repredicted"] = {"commit": "c1", "root": "runs/b"}
    out = bench_runtime.merge([a, b])
    assert out["repredicted"] == {"commit": "c1"}
    assert [p["repredicted"]["root"] for p in out["parts"]] == ["runs/a", "runs/b"]
    # predicted again at different commits (or only some): no one commit for the table;
    # each part keeps its own
    b["repredicted"] = {"commit": "c2", "root": "runs/b"}
    out = bench_runtime.merge([a, b])
    assert "repredicted" not in out
    assert [p["repredicted"]["commit"] for p in out["parts"]] == ["c1", "c2"]
    del a["repredicted"]
    assert "repredicted" not in bench_runtime.merge([a, b])
