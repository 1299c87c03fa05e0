"""deploy/prometheus.yml passes promtool; the Grafana dashboard is current, well-formed PromQL."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "dashboards/grafana/expertmesh.json"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (make test installs Debian's prometheus)"
)


def _maker() -> ModuleType:
    path = REPO / "dashboards/grafana/make_dashboard.py"
    spec = importlib.util.spec_from_file_location("make_dashboard", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_dashboard"] = mod
    spec.loader.exec_module(mod)
    return mod


def _exprs() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def test_dashboard_json_is_what_the_generator_writes() -> None:
    assert DASHBOARD.read_text() == _maker().render(), "run dashboards/grafana/make_dashboard.py"


def test_dashboard_panels_are_well_formed() -> None:
    d = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    boxes = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        cells = {(g["x"] + i, g["y"] + j) for i in range(g["w"]) for j in range(g["h"])}
        assert not boxes & cells, f"panel {p['title']!r} overlaps another"
        boxes |= cells
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"]
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "job"} <= names


def test_every_query_reads_controller_metrics() -> None:
    for expr in _exprs():
        assert re.search(r"\bexpertmesh_[a-z0-9_]+", expr), expr
        assert '{job=~"$job"}' in expr, expr


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses every panel query (as recording rules; $job filled in)."""
    rules = [
        {"record": f"expertmesh:panel_query_{i}", "expr": e.replace("$job", ".*")}
        for i, e in enumerate(_exprs())
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    out = subprocess.run(
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_prometheus_config_passes_promtool() -> None:
    out = subprocess.run(
        [PROMTOOL, "check", "config", str(REPO / "deploy/prometheus.yml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_rejects_a_broken_config(tmp_path: Path) -> None:
    cfg = yaml.safe_load((REPO / "deploy/prometheus.yml").read_text())
    cfg["scrape_configs"][0]["scrape_interval"] = "often"
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump(cfg))
    out = subprocess.run([PROMTOOL, "check", "config", str(bad)], capture_output=True, check=False)
    assert out.returncode != 0


def test_prometheus_scrapes_the_controller_and_ray_discovery() -> None:
    cfg = yaml.safe_load((REPO / "deploy/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    ctl = jobs["expertmesh-controller"]
    assert ctl["metrics_path"] == "/metrics"
    head_ip = yaml.safe_load((REPO / "deploy/cluster.yaml").read_text())["provider"]["head_ip"]
    assert ctl["static_configs"][0]["targets"] == [f"{head_ip}:8700"]
    (sd,) = jobs["ray"]["file_sd_configs"]
    from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE

    assert sd["files"] == [f"/tmp/ray/session_latest/{PROMETHEUS_SERVICE_DISCOVERY_FILE}"]
