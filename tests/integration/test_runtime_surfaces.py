"""The demo's runtime (the SPMD plane) serves the control plane from its controller actor,
fed every step."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from expertmesh.controller.core import Trigger
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.planner import Topology
from expertmesh.runtime.settings import RuntimeSettings
from expertmesh.runtime.spmd import SpmdRuntime
from expertmesh.workers.model import LMConfig

LM = LMConfig(num_layers=2, num_experts=8, top_k=2, hidden=16, ffn_hidden=16, batch=4, seq_len=32)
STEPS = 6


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _settings() -> RuntimeSettings:
    """2 DCs x 2 ranks, static planned every step, REST and gRPC on free ports."""
    topo = Topology.generate(2, 2, masters=2, spare=2).with_inter_dc(0.5, 2.0)
    return RuntimeSettings(
        topology=topo.to_dict(),
        lm=LM,
        policy="static",
        trigger=Trigger(mode="every_step"),
        corpus_bytes=200_000,
        surfaces=SurfaceSettings(rest_port=0, grpc_port=0),
    )


def test_rest_and_metrics_serve_the_runtimes_data() -> None:
    settings = _settings()
    topo = Topology.from_dict(settings.topology)
    with SpmdRuntime(settings) as rt:
        assert rt.surfaces is not None
        url = rt.surfaces["rest_url"]
        steps = rt.train(STEPS)
        status = rt.status()
        with httpx.Client(base_url=url, timeout=10) as http:
            latest = http.get("/api/v1/plans/latest")
            metrics = http.get("/metrics")
            health = http.get("/api/v1/health")
        assert rt.metrics() == metrics.text  # the actor's telemetry is what /metrics serves
    assert health.status_code == 200
    assert latest.status_code == 200, latest.text
    plan = latest.json()
    assert plan["version"] == status["version"] >= steps[-1].plan_version
    assert plan["policy"] == "static" and len(plan["layers"]) == LM.num_layers

    m = _samples(metrics.text)
    assert m[("expertmesh_step_seconds_count", ())] == STEPS
    assert m[("expertmesh_step_seconds_sum", ())] == pytest.approx(sum(s.seconds for s in steps))
    assert m[("expertmesh_step_loss", ())] == steps[-1].loss
    assert m[("expertmesh_plan_version", ())] == status["version"]
    for r, tokens in enumerate(steps[-1].tokens_per_rank):
        assert m[("expertmesh_rank_tokens", (("rank", str(r)),))] == tokens
        assert m[("expertmesh_worker_up", (("rank", str(r)),))] == 1.0
    names = [d["name"] for d in topo.to_dict()["dcs"]]
    for kind, k in (("tokens", 0), ("weights", 1)):
        sent = np.sum([np.asarray(s.bytes_by_pair)[k] for s in steps], axis=0)
        if kind == "weights":
            sent += np.sum([np.asarray(s.bytes_by_pair)[2] for s in steps], axis=0)
        for a in range(2):
            for b in range(2):
                if a == b or sent[a, b] == 0:
                    continue
                key = (
                    "expertmesh_cross_dc_bytes_total",
                    (("dst_dc", names[b]), ("kind", kind), ("src_dc", names[a])),
                )
                assert m[key] == sent[a, b]
    assert sum(np.asarray(s.bytes_by_pair)[0].sum() for s in steps) > 0


def test_the_surfaces_come_back_after_a_controller_restart() -> None:
    """Ray restarts a crashed controller actor (here: it exits right after the workers
    switched to a plan the store does not have yet); it serves REST again (on new ports when
    they were picked freely) with the plan it learned from the workers."""
    settings = _settings().model_copy(update={"policy": "eplb"})
    with SpmdRuntime(settings) as rt:
        assert rt.surfaces is not None
        rt.train(2)
        ray.get(rt.controller.inject_crash.remote("applied"))
        rt.train(4)  # the crash, the restart, and steps after it
        status = rt.status()
        with httpx.Client(base_url=rt.surfaces["rest_url"], timeout=10) as http:
            health = http.get("/api/v1/health")
            latest = http.get("/api/v1/plans/latest")
    assert status["restarted"]
    assert health.status_code == 200
    assert latest.status_code == 200, latest.text
    assert latest.json()["version"] == status["version"] >= 1


def test_the_plan_list_and_the_first_plans_migrations() -> None:
    """#15 items 1 and 3 on the real runtime: the plan list (REST, dashboard) reads the store
    the commits go to (the demo's listed nothing), and the first plan's migrations from the
    static placement the workers start from are in its summary and in /metrics (they were 0
    and absent while the workers moved the copies)."""
    settings = _settings().model_copy(update={"policy": "eplb", "policy_settings": {"period": 2}})
    with SpmdRuntime(settings) as rt:
        assert rt.surfaces is not None
        steps = rt.train(10)
        status = rt.status()
        with httpx.Client(base_url=rt.surfaces["rest_url"], timeout=10) as http:
            page = http.get("/api/v1/plans").json()
            board = http.get("/api/v1/dashboard").json()
            metrics = http.get("/metrics").text
    versions = list(range(status["version"], 0, -1))
    assert status["version"] >= 2, [s.plan_version for s in steps]
    assert page["total"] == len(versions) and [p["version"] for p in page["items"]] == versions
    assert [p["version"] for p in board["plans"]] == versions
    first = page["items"][-1]
    assert sum(s.cross_dc_migration_bytes for s in steps) > 0 and first["migrations"] > 0
    m = _samples(metrics)
    counted = sum(v for (name, _), v in m.items() if name == "expertmesh_migrations_total")
    assert counted == sum(p["migrations"] for p in page["items"])
