import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from expertmesh.controller.api import create_app
from expertmesh.controller.core import ControllerCore, ControllerSettings
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.controller.store import SqlitePlanStore
from expertmesh.controller.telemetry import Telemetry
from expertmesh.planner import ModelSpec, Topology

TOKEN = "s3cret-token"
R, E, L = 4, 8, 2


def _make(token: str | None = TOKEN, **settings):
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    model = ModelSpec(num_layers=L, num_experts=E, top_k=2, hidden=16, ffn_hidden=8)
    store = SqlitePlanStore(":memory:")
    core = ControllerCore(
        topo, model, ControllerSettings(trigger={"mode": "every_step"}), store=store
    )
    tel = Telemetry(core)
    app = create_app(
        core, tel, store, SurfaceSettings(token=token, max_body_bytes=64 * 1024, **settings)
    )
    return core, TestClient(app)


def _commit(core, step, seed=0):
    rng = np.random.default_rng(seed + step)
    for layer in range(L):
        core.report_layer(step, layer, rng.integers(0, 50, (R, E)))
    return core.commit(core.plan(step).version)


@pytest.fixture
def env():
    return _make()


def _state(core):
    return (
        core.reports_received,
        [core.window(layer).tolist() for layer in range(L)],
        dict(core.loads._pending),
        core.settings,
        core.committed.version if core.committed else None,
    )


def test_topology_and_layers(env):
    core, c = env
    t = c.get("/api/v1/topology").json()
    assert t["num_ranks"] == R and [d["name"] for d in t["dcs"]] == ["dc0000", "dc0001"]
    assert t["model"]["num_experts"] == E and len(t["dc_links"]) == 1
    _commit(core, 0)
    layers = c.get("/api/v1/layers").json()["layers"]
    assert len(layers) == L and layers[0]["loads"] == 1 and len(layers[0]["expert_load"]) == E
    one = c.get("/api/v1/layers/1").json()
    assert one["imbalance"] == pytest.approx(core.layer_stats(1).imbalance)
    assert c.get("/api/v1/layers/7").status_code == 404


def test_plans_history_latest_version_layer_and_diff(env):
    core, c = env
    assert c.get("/api/v1/plans/latest").status_code == 404
    for step in range(3):
        _commit(core, step)
    page = c.get("/api/v1/plans", params={"limit": 2}).json()
    assert page["total"] == 3 and [p["version"] for p in page["items"]] == [3, 2]
    page2 = c.get("/api/v1/plans", params={"limit": 2, "offset": 2}).json()
    assert [p["version"] for p in page2["items"]] == [1]
    latest = c.get("/api/v1/plans/latest").json()
    assert latest["version"] == 3 and len(latest["layers"]) == L
    assert latest["layers"][0]["phy2log"] == core.committed.layers[0].phy2log.tolist()
    assert latest["layers"][0]["route"] is None
    v1 = c.get("/api/v1/plans/1", params={"route": True}).json()
    assert v1["version"] == 1 and v1["layers"][0]["route"]
    lay = c.get("/api/v1/plans/2/layers/1").json()
    assert lay["layer"] == 1 and sum(r[3] for r in lay["route"]) == sum(lay["rank_tokens"])
    diff = c.get("/api/v1/plans/diff", params={"from": 1, "to": 3}).json()
    assert diff["from_version"] == 1 and diff["to_version"] == 3 and len(diff["layers"]) == L
    assert c.get("/api/v1/plans/99").status_code == 404
    assert c.get("/api/v1/plans/2/layers/9").status_code == 404
    assert c.get("/api/v1/plans/diff", params={"from": 1, "to": 99}).status_code == 404
    assert c.get("/api/v1/plans/0").status_code == 422
    assert c.get("/api/v1/plans", params={"limit": 0}).status_code == 422


def test_history_reads_the_store_after_a_restart(tmp_path):
    db = tmp_path / "plans.sqlite"
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    model = ModelSpec(num_layers=L, num_experts=E, hidden=16, ffn_hidden=8)
    store = SqlitePlanStore(db)
    core = ControllerCore(topo, model, store=store)
    _commit(core, 0)
    _commit(core, 1)
    store.close()
    store2 = SqlitePlanStore(db)
    core2 = ControllerCore(topo, model, store=store2)
    store2.recover(core2)
    c = TestClient(create_app(core2, Telemetry(core2), store2, SurfaceSettings()))
    assert [p["version"] for p in c.get("/api/v1/plans").json()["items"]] == [2, 1]
    assert c.get("/api/v1/plans/1").json()["version"] == 1  # only in the store
    assert c.get("/api/v1/plans/latest").json()["version"] == 2


def test_what_if_solve_applies_nothing(env):
    core, c = env
    _commit(core, 0)
    before = _state(core)
    load = np.random.default_rng(5).integers(0, 100, (R, E)).tolist()
    r = c.post("/api/v1/solve", json={"load": load, "policy": "static"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["policy"] == "static" and body["imbalance_after"] >= 1.0
    assert sum(row[3] for row in body["plan"]["route"]) == int(np.sum(load))
    assert _state(core) == before and len(core.versions()) == 1
    bad = c.post("/api/v1/solve", json={"load": load, "policy": "nope"})
    assert bad.status_code == 422 and "unknown policy" in bad.json()["error"]
    assert c.post("/api/v1/solve", json={"load": load[:2]}).status_code == 422
    assert c.post("/api/v1/solve", json={"load": load, "layer": 5}).status_code == 404


def test_policy_read_and_authenticated_change(env):
    core, c = env
    p = c.get("/api/v1/policy").json()
    assert p["policy"] == "static" and "static" in p["available"]
    body = {"policy": "static", "window": 5, "trigger": {"mode": "every_n", "every": 3}}
    assert c.put("/api/v1/policy", json=body).status_code == 401
    wrong = c.put("/api/v1/policy", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and core.settings.window == 16
    ok = c.put("/api/v1/policy", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200, ok.text
    assert core.settings.window == 5 and core.settings.trigger.every == 3
    bad = c.put(
        "/api/v1/policy",
        json={"policy": "nope"},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert bad.status_code == 422 and core.settings.window == 5


def test_policy_change_keeps_the_settings_the_body_leaves_out(env):
    core, c = env
    core.configure(core.settings.model_copy(update={"max_pending_steps": 64}))
    ok = c.put(
        "/api/v1/policy",
        json={"policy": "static", "window": 7},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert ok.status_code == 200, ok.text
    assert core.settings.window == 7 and core.settings.max_pending_steps == 64


def test_without_a_configured_token_writes_are_refused():
    _core, c = _make(token=None)
    r = c.put("/api/v1/policy", json={"policy": "static"}, headers={"Authorization": "Bearer x"})
    assert r.status_code == 403 and "no token" in r.json()["error"]


def test_reports_over_rest(env):
    core, c = env
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for rank in range(R):
        r = c.post(
            "/api/v1/reports",
            json={"step": 0, "layer": 0, "rank": rank, "load": [1] * E},
            headers=auth,
        )
        assert r.status_code == 200, r.text
    assert r.json()["complete"] is True and core.window(0).shape == (1, R, E)
    r = c.post(
        "/api/v1/reports/layer", json={"step": 0, "layer": 1, "load": [[2] * E] * R}, headers=auth
    )
    assert r.status_code == 200 and core.window(1)[0, 0, 0] == 2
    assert core.reports_received == R + 1 and core.reports_rejected == 0


GOOD = {"step": 3, "layer": 0, "rank": 0, "load": [1] * E}


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b'{"step": 3, "layer": 0, "rank": 0, "load": [NaN, 1, 1, 1, 1, 1, 1, 1]}', 422),
        ({**GOOD, "load": [1] * (E - 1)}, 422),
        ({**GOOD, "load": [-1] + [1] * (E - 1)}, 422),
        ({**GOOD, "load": [1.5] + [1] * (E - 1)}, 422),
        ({**GOOD, "load": ["1"] * E}, 422),
        ({**GOOD, "load": [2**50] * E}, 422),
        ({**GOOD, "layer": 9}, 422),
        ({**GOOD, "rank": 99}, 422),
        ({**GOOD, "extra": 1}, 422),
        ({"step": 3, "layer": 0}, 422),
        ([1, 2, 3], 422),
        ({**GOOD, "load": [1] * 40_000}, 413),
    ],
)
def test_bad_reports_are_refused_counted_and_change_nothing(env, body, status):
    core, c = env
    auth = {"Authorization": f"Bearer {TOKEN}"}
    before = _state(core)
    if isinstance(body, bytes):
        r = c.post(
            "/api/v1/reports", content=body, headers={**auth, "content-type": "application/json"}
        )
    else:
        r = c.post("/api/v1/reports", json=body, headers=auth)
    assert r.status_code == status, r.text
    assert isinstance(r.json()["error"], str) and r.json()["error"]
    assert core.reports_rejected == 1 and core.reports_received == before[0] + 1
    assert _state(core)[1:] == before[1:]


def test_reports_without_the_token_are_refused_and_counted(env):
    core, c = env
    r = c.post("/api/v1/reports", json=GOOD)
    assert r.status_code == 401 and core.reports_rejected == 1 and not core.loads._pending


def test_reports_open_when_no_token_is_configured():
    _core, c = _make(token=None)
    assert c.post("/api/v1/reports", json=GOOD).status_code == 200


def test_bad_layer_report_shape(env):
    core, c = env
    r = c.post(
        "/api/v1/reports/layer",
        json={"step": 0, "layer": 0, "load": [[1] * E] * (R - 1)},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 422 and core.reports_rejected == 1


def test_chunked_oversized_body_is_refused(env):
    core, c = env

    def chunks():
        for _ in range(100):
            yield b" " * 1024

    r = c.post(
        "/api/v1/reports",
        content=chunks(),
        headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
    )
    assert r.status_code == 413 and core.reports_rejected == 1


def test_health_ready_metrics_docs_and_dashboard(env):
    core, c = env
    assert c.get("/api/v1/health").json() == {"status": "ok"}
    assert c.get("/api/v1/ready").json()["ready"] is True
    assert "expertmesh_load_reports_received_total" in c.get("/metrics").text
    schema = c.get("/openapi.json").json()
    assert "/api/v1/plans/{version}" in schema["paths"]
    assert c.get("/docs").status_code == 200
    _commit(core, 0)
    d = c.get("/api/v1/dashboard").json()
    assert len(d["heatmap"]) == L and len(d["heatmap"][0]) == E
    assert d["plan_version"] == 1 and len(d["workers"]) == R
    page = c.get("/")
    assert page.status_code == 200 and "content-security-policy" in page.headers
    assert c.get("/api/v1/dashboard", params={"layer": 9}).status_code == 404


def test_not_ready_when_a_surface_is_down():
    topo = Topology.generate(dcs=1, ranks_per_dc=2, masters=4, spare=0)
    core = ControllerCore(topo, ModelSpec(num_layers=1, num_experts=8))
    store = SqlitePlanStore(":memory:")
    app = create_app(core, Telemetry(core), store, ready_checks={"grpc": lambda: False})
    r = TestClient(app).get("/api/v1/ready")
    assert r.status_code == 503 and r.json()["checks"] == {"store": True, "grpc": False}


def test_a_committed_plan_is_rendered_before_anyone_asks():
    core, client = _make()
    _commit(core, 0)
    before = list(core.listeners)
    with client:  # the server's lifespan: the plan committed before it starts is rendered too
        state = client.app.state.expertmesh
        for step in (1, 2):
            pv = _commit(core, step)
            deadline = time.monotonic() + 10
            while (pv.version, False) not in state.plan_json and time.monotonic() < deadline:
                time.sleep(0.01)
            body = state.plan_json[(pv.version, False)]
            got = client.get("/api/v1/plans/latest")
            assert got.status_code == 200 and got.content == body
            assert got.json()["version"] == pv.version and got.json()["state"] == "committed"
        assert (1, False) in state.plan_json
        assert len(core.listeners) == len(before) + 1
    assert core.listeners == before  # the server stopped: nothing renders at commit any more
    _commit(core, 3)
    time.sleep(0.2)
    assert (4, False) not in state.plan_json


def test_a_prepared_plan_is_served_from_memory_and_an_unknown_one_is_named(env):
    """A prepared plan is not in the store yet: REST finds it in the controller's memory (a
    lookup that went to the store first, or asked memory for another version, would 404)."""
    core, c = env
    _commit(core, 0)
    rng = np.random.default_rng(5)
    for layer in range(L):
        core.report_layer(1, layer, rng.integers(0, 50, (R, E)))
    pv = core.plan(1)
    assert pv.state == "prepared" and c.app.state.expertmesh.store.get(pv.version) is None
    got = c.get(f"/api/v1/plans/{pv.version}")
    assert got.status_code == 200 and got.json()["state"] == "prepared"
    assert got.json()["layers"][0]["phy2log"] == pv.layers[0].phy2log.tolist()
    assert c.get(f"/api/v1/plans/{pv.version}/layers/0").status_code == 200
    diff = c.get("/api/v1/plans/diff", params={"from": 1, "to": pv.version})
    assert diff.status_code == 200 and diff.json()["to_version"] == pv.version
    missing = c.get("/api/v1/plans/99")
    assert missing.status_code == 404 and missing.json() == {"error": "unknown plan version 99"}
