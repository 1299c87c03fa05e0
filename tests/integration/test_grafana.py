"""Every metric the Grafana dashboard queries exists on a live controller's /metrics, and every
metric family the controller exports has a panel."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from expertmesh.controller.core import ControllerCore, ControllerSettings
from expertmesh.controller.server import Surfaces
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.planner import ModelSpec, Topology

REPO = Path(__file__).resolve().parents[2]
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
}
R, E, L, D = 4, 8, 2, 2


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """Metric families on a live /metrics after a few steps and a committed plan."""
    topo = Topology.generate(dcs=D, ranks_per_dc=R // D, masters=2, spare=1)
    model = ModelSpec(num_layers=L, num_experts=E, top_k=2, hidden=16, ffn_hidden=8)
    core = ControllerCore(topo, model, ControllerSettings(trigger={"mode": "every_step"}))
    db = tmp_path_factory.mktemp("grafana") / "plans.sqlite"
    with Surfaces(core, SurfaceSettings(rest_port=0, grpc_port=0, db_path=str(db))) as s:
        rng = np.random.default_rng(0)
        for rank in range(R):
            s.telemetry.set_worker_state(rank, True)
        for step in range(3):
            for layer in range(L):
                core.report_layer(step, layer, rng.integers(0, 50, (R, E)))
            pv = core.maybe_plan(step)
            if pv is not None:
                core.commit(pv.version)
            cross = np.array([[0, 1000], [2000, 0]])
            s.telemetry.record_step(
                step, 0.1, 2.5, np.full(R, 64), cross_dc_token_bytes=cross,
                cross_dc_weight_bytes=cross // 10,
            )  # fmt: skip
            s.telemetry.record_balance(
                step, imbalance=1.1, imbalance_static=1.5, balancedness=[0.9] * L, replicas=3,
                fanout_bytes=4096, balance_seconds=0.002, seconds=0.1, planner=[[1.05] * L],
            )  # fmt: skip
        text = httpx.get(f"{s.rest_url}/metrics", timeout=10).text
    yield {f.name: f for f in text_string_to_metric_families(text)}


def _queried() -> set[str]:
    d = json.loads((REPO / "dashboards/grafana/expertmesh.json").read_text())
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    return {m for e in exprs for m in re.findall(r"\bexpertmesh_[a-z0-9_]+", e)}


def _family_of(name: str, families: dict) -> str | None:
    for fam in families.values():
        if name == fam.name and fam.type in ("gauge", "untyped"):
            return fam.name
        if any(name == fam.name + sfx for sfx in SUFFIXES.get(fam.type, ())):
            return fam.name
    return None


def test_every_queried_metric_is_on_live_metrics(families: dict) -> None:
    missing = sorted(q for q in _queried() if _family_of(q, families) is None)
    assert not missing, f"the dashboard queries metrics /metrics does not export: {missing}"


def test_every_exported_family_has_a_panel(families: dict) -> None:
    used = {_family_of(q, families) for q in _queried()}
    # prometheus_client also exposes each counter's and histogram's creation time as a
    # `<name>_created` gauge; that is a timestamp of the family, not a family of its own.
    exported = {
        n
        for n in families
        if n.startswith("expertmesh_") and n.removesuffix("_created") not in families.keys() - {n}
    }
    assert exported, "no expertmesh_ metrics on /metrics"
    assert not exported - used, f"families without a panel: {sorted(exported - used)}"


def test_unlabeled_families_have_samples(families: dict) -> None:
    for name in ("expertmesh_step", "expertmesh_step_loss", "expertmesh_tokens",
                 "expertmesh_step_seconds", "expertmesh_load_reports_received"):  # fmt: skip
        assert families[name].samples, name
    pairs = {
        (s.labels["src_dc"], s.labels["dst_dc"], s.labels["kind"])
        for s in families["expertmesh_cross_dc_bytes"].samples
        if s.name.endswith("_total")
    }
    assert len(pairs) == 4  # 2 ordered pairs x {tokens, weights}
