"""GET /api/v1/balance and the measured-balance series on /metrics, asked as an outside client
over a real socket (the runtime's side, record_balance, fed as the SPMD controller does)."""

from __future__ import annotations

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from expertmesh.controller.core import ControllerCore
from expertmesh.controller.server import Surfaces
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.controller.telemetry import Telemetry, TelemetrySettings
from expertmesh.planner import ModelSpec, Topology

L, R = 3, 4


def _core() -> ControllerCore:
    topo = Topology.generate(dcs=2, ranks_per_dc=R // 2, masters=2, spare=1)
    return ControllerCore(topo, ModelSpec(num_layers=L, num_experts=8, top_k=2))


def _feed(tel: Telemetry, steps: range, seed: int = 0) -> list[dict]:
    """Each step: [R, L] tokens computed per rank; the record the runtime would make of it."""
    rng = np.random.default_rng(seed)
    out = []
    for step in steps:
        per_mb = rng.integers(20, 100, (2, R, L))  # two microbatches
        computed = per_mb.sum(axis=0)
        ratio = per_mb.max(axis=1) / per_mb.mean(axis=1)  # [2, L]
        floor = 1.0 + rng.random((2, L)) / 10
        rec = {
            "imbalance": float(ratio.max()),
            "imbalance_static": float(1.5 + rng.random()),
            "balancedness": [float(computed[:, i].mean() / computed[:, i].max()) for i in range(L)],
            "replicas": int(rng.integers(0, 9)),
            "fanout_bytes": int(rng.integers(0, 10_000)),
            "balance_seconds": float(rng.random() / 100),
            "seconds": float(0.2 + rng.random()),
            "microbatches": ratio.tolist(),
            "within_dc": (ratio / floor).tolist(),
            "floor": floor.tolist(),
            "planner": np.maximum(1.0, ratio - 0.01).tolist(),
        }
        tel.record_balance(step, **rec)
        level = float(np.maximum(1.0, ratio - 0.01).max())
        out.append({"step": step, **rec, "imbalance_planner": level})
    return out


def test_balance_resource_returns_measured_steps_bounded_and_filtered(tmp_path):
    core = _core()
    tel = Telemetry(core, TelemetrySettings(history=8))
    with Surfaces(core, SurfaceSettings(rest_port=0, grpc_port=0), telemetry=tel) as s:
        url = f"{s.rest_url}/api/v1/balance"
        empty = httpx.get(url, timeout=10)
        assert empty.status_code == 200
        assert empty.json() == {"steps": [], "num_layers": L, "history": 8}
        fed = _feed(s.telemetry, range(12))
        body = httpx.get(url, timeout=10).json()
        got = [{k: v for k, v in st.items() if k != "at"} for st in body["steps"]]
        assert got == fed[-8:]  # the bounded history, oldest first, values as recorded
        since = httpx.get(url, params={"since": 9}, timeout=10).json()["steps"]
        assert [st["step"] for st in since] == [9, 10, 11]
        newest = httpx.get(url, params={"limit": 2}, timeout=10).json()["steps"]
        assert [st["step"] for st in newest] == [10, 11]

        # the same newest step on /metrics
        text = httpx.get(f"{s.rest_url}/metrics", timeout=10).text
        samples = {
            (x.name, tuple(sorted(x.labels.items()))): x.value
            for f in text_string_to_metric_families(text)
            for x in f.samples
        }
        last = fed[-1]
        assert samples[("expertmesh_measured_imbalance_ratio", ())] == last["imbalance"]
        assert samples[("expertmesh_static_imbalance_ratio", ())] == last["imbalance_static"]
        assert samples[("expertmesh_planner_imbalance_ratio", ())] == last["imbalance_planner"]
        for i, row in enumerate(last["planner"]):
            for layer, x in enumerate(row):
                labels = (("layer", str(layer)), ("microbatch", str(i)))
                assert samples[("expertmesh_planner_microbatch_imbalance_ratio", labels)] == x
        for layer, b in enumerate(last["balancedness"]):
            key = ("expertmesh_measured_balancedness_ratio", (("layer", str(layer)),))
            assert samples[key] == b
        total = sum(x["replicas"] for x in fed)
        assert samples[("expertmesh_fast_loop_replicas_total", ())] == total
        # the dashboard's poll carries the same records
        dash = httpx.get(f"{s.rest_url}/api/v1/dashboard", timeout=10).json()
        assert [st["step"] for st in dash["balance"]] == list(range(4, 12))


def test_bad_queries_are_4xx_json_and_change_nothing():
    core = _core()
    with Surfaces(core, SurfaceSettings(rest_port=0, grpc_port=0)) as s:
        _feed(s.telemetry, range(3))
        url = f"{s.rest_url}/api/v1/balance"
        before = httpx.get(url, timeout=10).json()
        for params in ({"since": -1}, {"since": "x"}, {"limit": 0}, {"limit": 10**9}):
            r = httpx.get(url, params=params, timeout=10)
            assert r.status_code == 422, (params, r.status_code)
            assert "error" in r.json(), r.text
        assert httpx.get(url, timeout=10).json() == before
