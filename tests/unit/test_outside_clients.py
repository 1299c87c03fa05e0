"""The REST app as an outside client drives it (issue #15): the demo's plan list, what-if
``eplb`` on the load sent, migrations of the first plan.

The runtime's controller actor builds a :class:`ControllerCore`, attaches its own SQLite
store and a :class:`Telemetry`, then hands the core to :class:`Surfaces`
(``runtime/controller.py: ControllerActor.reset / start_surfaces``); these tests take the same
path without Ray.
"""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from expertmesh.controller.core import ControllerCore, ControllerSettings, Trigger
from expertmesh.controller.server import Surfaces
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.controller.store import SqlitePlanStore, summarize
from expertmesh.controller.telemetry import Telemetry
from expertmesh.planner import ModelSpec, Topology
from expertmesh.planner.static import static_placement

# the demo's defaults: 3 DCs x 2 ranks, 2 master + 4 spare slots, 2 layers x 12 experts, top-2
DEMO_TOPO = Topology.generate(3, 2, masters=2, spare=4)
DEMO_MODEL = ModelSpec(num_layers=2, num_experts=12, top_k=2, hidden=32, ffn_hidden=64)


def _actor_core(tmp_path, policy: str = "hybrid") -> tuple[ControllerCore, Telemetry, Surfaces]:
    """What ``ControllerActor`` builds: core, telemetry, its own store; then the surfaces."""
    core = ControllerCore(
        DEMO_TOPO,
        DEMO_MODEL,
        ControllerSettings(policy=policy, trigger=Trigger(mode="every_n", every=5)),
    )
    telemetry = Telemetry(core)
    store = SqlitePlanStore(str(tmp_path / "plans.sqlite"))
    store.save_settings(core.settings)
    core.attach_store(store)
    surfaces = Surfaces(core, SurfaceSettings(rest_port=0, grpc_port=0), telemetry=telemetry)
    return core, telemetry, surfaces


def _report_step(core: ControllerCore, step: int, rng: np.random.Generator) -> None:
    """Every rank's load of every layer, one report each (``ControllerActor.report_loads``)."""
    r, e = DEMO_TOPO.num_ranks, DEMO_MODEL.num_experts
    p = np.linspace(8, 1, e) ** 2
    for rank in range(r):
        for layer in range(DEMO_MODEL.num_layers):
            core.report_load(step, layer, rank, rng.multinomial(1024 * 2, p / p.sum()))


def test_the_plan_list_reads_the_store_the_commits_go_to(tmp_path):
    core, _, surfaces = _actor_core(tmp_path)
    client = TestClient(surfaces.app)
    rng = np.random.default_rng(0)
    for step in range(11):
        _report_step(core, step, rng)
        pv = core.maybe_plan(step)
        if pv is not None:
            core.commit(pv.version)
    versions = [pv.version for pv in core.versions() if pv.state == "committed"]
    assert core.committed is not None and core.committed.version == 3
    page = client.get("/api/v1/plans").json()
    assert page["total"] == 3, page
    assert [p["version"] for p in page["items"]] == [3, 2, 1]
    assert client.get("/api/v1/plans/latest").json()["version"] == 3
    assert [p["version"] for p in client.get("/api/v1/dashboard").json()["plans"]] == [3, 2, 1]
    assert versions[-1] == 3
    surfaces.stop()
    assert core.store is not None and core.store.count() == 3  # the actor's store stays open


@pytest.mark.parametrize("policy", ["hybrid", "eplb", "quota"])
def test_the_first_plan_migrates_from_the_static_placement(tmp_path, policy):
    core, telemetry, _ = _actor_core(tmp_path, policy)
    _report_step(core, 0, np.random.default_rng(1))
    pv = core.maybe_plan(0)
    assert pv is not None
    core.commit(pv.version)
    static = static_placement(
        DEMO_TOPO.num_ranks,
        DEMO_TOPO.slots_per_rank,
        DEMO_MODEL.num_experts,
        DEMO_TOPO.masters_per_rank,
    )
    moved = 0
    for lp in pv.layers:
        if np.array_equal(lp.placement.holds(), static.holds()):
            continue
        # the plan's transfers, round by round from the static placement, give its placement
        have = static.holds().copy()
        for rnd in sorted({t.round for t in lp.migration.transfers}):
            batch = [t for t in lp.migration.transfers if t.round == rnd]
            for t in batch:  # a second copy on the same rank is a local copy (0 bytes)
                assert have[t.src_rank, t.expert], t
                assert t.src_rank == t.dst_rank or not have[t.dst_rank, t.expert], t
            for t in batch:
                have[t.dst_rank, t.expert] = True
        assert (have >= lp.placement.holds()).all()
        assert lp.migration.copies > 0
        moved += lp.migration.copies
    assert moved > 0, f"{policy}: the first plan kept the static placement on every layer"
    assert summarize(pv).migrations == moved
    assert core.store is not None and core.store.summaries()[0].migrations == moved
    text = telemetry.render().decode()
    series = [line for line in text.splitlines() if line.startswith("expertmesh_migrations_total{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in series) == moved


HOT = 3


def _hot_load(r: int, e: int) -> list[list[int]]:
    load = np.full((r, e), 20, np.int64)
    load[:, HOT] = 400
    return load.tolist()


@pytest.mark.parametrize("from_committed", [True, False])
@pytest.mark.parametrize("knobs", [{}, {"period": 1, "window": 1}])
def test_what_if_eplb_plans_the_load_it_is_sent(tmp_path, from_committed, knobs):
    core, _, surfaces = _actor_core(tmp_path, "static")
    client = TestClient(surfaces.app)
    schema = client.get("/openapi.json").json()
    assert "post" in schema["paths"]["/api/v1/solve"]
    r, e = DEMO_TOPO.num_ranks, DEMO_MODEL.num_experts
    rng = np.random.default_rng(2)
    window = [rng.integers(15, 25, (r, e)) for _ in range(2)]  # even-ish loads so far
    for step, load in enumerate(window):
        for layer in range(DEMO_MODEL.num_layers):
            core.report_layer(step, layer, load)
    core.commit(core.plan(1).version)  # static
    body = {
        "load": _hot_load(r, e),
        "policy": "eplb",
        "policy_settings": knobs,
        "from_committed": from_committed,
    }
    got = client.post("/api/v1/solve", json=body)
    assert got.status_code == 200, got.text
    out = got.json()
    logcnt = out["plan"]["logcnt"]
    assert logcnt[HOT] == max(logcnt) and logcnt[HOT] >= 3, logcnt
    assert out["imbalance_after"] < 0.6 * out["imbalance_before"], out
    # one path: the what-if equals the plan the controller makes when that load is its
    # newest complete one
    twin = ControllerCore(
        DEMO_TOPO, DEMO_MODEL, ControllerSettings(policy="eplb", policy_settings=knobs)
    )
    for step, load in enumerate([*window, np.array(body["load"])]):
        for layer in range(DEMO_MODEL.num_layers):
            twin.report_layer(step, layer, load)
    if from_committed:
        twin.restore(core.committed)
    plan = twin.plan(ControllerCore.WHAT_IF_STEP)
    assert out["plan"]["phy2log"] == plan.layers[0].phy2log.tolist()


def _metrics(client: TestClient) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_no_data_is_absent_not_perfect(tmp_path):
    core, telemetry, surfaces = _actor_core(tmp_path, "static")
    client = TestClient(surfaces.app)
    m = _metrics(client)
    assert not [k for k in m if k.endswith("_created")], "created timestamps are exported"
    for absent in ("expertmesh_step_loss", "expertmesh_step"):
        assert absent not in m, absent
    assert not [k for k in m if k.startswith("expertmesh_layer_")], "imbalance before any load"
    # counters start at 0 (nothing counted is a value), migrations for every DC pair
    assert m["expertmesh_load_reports_received_total"] == 0
    pairs = [k for k in m if k.startswith("expertmesh_migrations_total{")]
    assert len(pairs) == DEMO_TOPO.num_dcs * (DEMO_TOPO.num_dcs - 1)
    # a load for layer 0 only: layer 0 gets a value, layer 1 stays absent
    r, e = DEMO_TOPO.num_ranks, DEMO_MODEL.num_experts
    core.report_layer(0, 0, np.full((r, e), 5))
    m = _metrics(client)
    assert m['expertmesh_layer_imbalance_ratio{layer="0"}'] == pytest.approx(
        core.layer_stats(0).imbalance
    )
    assert 'expertmesh_layer_imbalance_ratio{layer="1"}' not in m
    assert 'expertmesh_layer_balancedness_ratio{layer="1"}' not in m
    # a step without a loss (serve never has one): the step, still no loss
    telemetry.record_step(3, 0.1, None, np.ones(r))
    m = _metrics(client)
    assert m["expertmesh_step"] == 3 and "expertmesh_step_loss" not in m
    telemetry.record_step(4, 0.1, 2.5, np.ones(r))
    assert _metrics(client)["expertmesh_step_loss"] == 2.5
    # the dashboard's per-layer imbalance: null where there is no load
    assert client.get("/api/v1/dashboard").json()["layer_imbalance"][1] is None


def test_head_metrics_and_the_allow_header_of_405(tmp_path):
    _, _, surfaces = _actor_core(tmp_path, "static")
    client = TestClient(surfaces.app)
    head = client.head("/metrics")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"].startswith("text/plain")
    schema = client.get("/openapi.json").json()
    for path, ops in schema["paths"].items():
        if "{" in path:
            continue
        served = {m.upper() for m in ops}
        for method in ("OPTIONS", "DELETE", "POST", "PUT", "PATCH"):
            if method in served:
                continue
            got = client.request(method, path)
            assert got.status_code == 405, (method, path, got.status_code)
            assert set(got.headers["allow"].split(", ")) == served, (method, path)
    got = client.request("DELETE", "/api/v1/policy")
    assert got.headers["allow"] == "GET, PUT"
