"""REST and gRPC on real loopback servers (free ports) around one core."""

import queue
import threading

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertmesh.controller.core import ControllerCore, ControllerSettings
from expertmesh.controller.server import Surfaces
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.planner import ModelSpec, Topology
from expertmesh.v1 import convert
from expertmesh.v1 import expertmesh_pb2 as pb
from expertmesh.v1 import expertmesh_pb2_grpc as pb_grpc
from expertmesh.workers.client import ExpertMeshClient

TOKEN = "integration-token"
R, E, L = 4, 8, 2
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def _core():
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    model = ModelSpec(num_layers=L, num_experts=E, top_k=2, hidden=16, ffn_hidden=8)
    return ControllerCore(topo, model, ControllerSettings(trigger={"mode": "every_step"}))


@pytest.fixture
def live(tmp_path):
    core = _core()
    settings = SurfaceSettings(
        rest_port=0, grpc_port=0, token=TOKEN, db_path=str(tmp_path / "plans.sqlite")
    )
    with Surfaces(core, settings) as s:
        yield core, s


def _step(core, step, seed=0):
    rng = np.random.default_rng(seed + step)
    for layer in range(L):
        core.report_layer(step, layer, rng.integers(0, 50, (R, E)))


def test_reports_over_grpc_complete_steps_and_reconcile(live):
    core, s = live
    with ExpertMeshClient(s.grpc_target, token=TOKEN) as c:
        c.wait_ready()
        assert c.healthy() and c.healthy("expertmesh.v1.ExpertMeshService")
        reports = [
            convert.Report(step, layer, rank, np.full(E, rank + 1))
            for step in range(3)
            for layer in range(L)
            for rank in range(R)
        ]
        assert c.report(reports, batch=5) == len(reports)
    assert core.reports_received == len(reports) and core.reports_rejected == 0
    assert core.window(0).shape == (3, R, E) and core.window(1)[2, 3, 0] == 4


@pytest.mark.parametrize(
    "report",
    [
        pb.LoadReport(step=0, layer=9, rank=0, load=[1] * E),
        pb.LoadReport(step=0, layer=0, rank=99, load=[1] * E),
        pb.LoadReport(step=0, layer=0, rank=0, load=[1] * 3),
        pb.LoadReport(step=0, layer=0, rank=0, load=[-1] * E),
        pb.LoadReport(step=0, layer=0, rank=0, load=[2**50] * E),
        pb.LoadReport(step=0, layer=0, rank=1, load=[1] * E),  # duplicate of the good one
    ],
)
def test_bad_grpc_reports_are_refused_counted_and_change_nothing(live, report):
    core, s = live
    good = pb.LoadReport(step=0, layer=0, rank=1, load=[1] * E)
    with grpc.insecure_channel(s.grpc_target) as ch:
        stub = pb_grpc.ExpertMeshServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportLoad(
                iter([pb.ReportLoadRequest(reports=[good, report, good])]), metadata=AUTH
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details()
        # the first good report stays; the bad one and the one after it are rejected
        assert core.reports_received == 3 and core.reports_rejected == 2
        assert core.window(0).shape[0] == 0 and list(core.loads._pending) == [(0, 0)]
        # the server keeps serving
        more = pb.LoadReport(step=0, layer=0, rank=2, load=[1] * E)
        ok = stub.ReportLoad(iter([pb.ReportLoadRequest(reports=[more])]), metadata=AUTH)
        assert ok.accepted == 1


def test_grpc_reports_need_the_token(live):
    core, s = live
    with ExpertMeshClient(s.grpc_target, token="wrong") as c, pytest.raises(grpc.RpcError) as err:
        c.report([convert.Report(0, 0, 0, np.ones(E, int))])
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert core.reports_rejected == 1 and not core.loads._pending


def test_too_many_reports_in_a_message_is_resource_exhausted(live):
    core, s = live
    with grpc.insecure_channel(s.grpc_target) as ch:
        stub = pb_grpc.ExpertMeshServiceStub(ch)
        msg = pb.ReportLoadRequest(reports=[pb.LoadReport(load=[1] * E)] * 5000)
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportLoad(iter([msg]), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert core.reports_rejected == 5000 and not core.loads._pending


def test_oversized_grpc_message_is_refused_and_serving_goes_on():
    core = _core()
    settings = SurfaceSettings(rest_port=0, grpc_port=0, max_message_bytes=4096)
    with Surfaces(core, settings) as s, grpc.insecure_channel(s.grpc_target) as ch:
        stub = pb_grpc.ExpertMeshServiceStub(ch)
        msg = pb.ReportLoadRequest(reports=[pb.LoadReport(load=[1] * 10_000)])
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportLoad(iter([msg]))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as err:
            stub.GetPlan(pb.GetPlanRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_plans_stream_get_and_solve(live):
    core, s = live
    with ExpertMeshClient(s.grpc_target, token=TOKEN) as c:
        assert c.get_plan() is None
        _step(core, 0)
        core.commit(core.plan(0).version)
        watch = c.watch_plans()
        got: queue.Queue = queue.Queue()

        def consume():
            for plan in watch:
                got.put(plan)
                if plan.version == 3:
                    return

        t = threading.Thread(target=consume, daemon=True)
        t.start()
        # plan 1 was committed before the call: it comes as the current plan, and once it has
        # come the watcher is subscribed; each later commit waits for the one before to arrive
        seen = [got.get(timeout=30)]
        for step in (1, 2):
            _step(core, step)
            core.commit(core.plan(step).version)
            seen.append(got.get(timeout=30))
        t.join(30)
        watch.cancel()
        assert [p.version for p in seen] == [1, 2, 3] and got.empty() and not t.is_alive()
        assert np.array_equal(seen[-1].layers[0].phy2log, core.committed.layers[0].phy2log)
        latest = c.get_plan(include_route=True)
        assert latest.version == 3 and latest.layers[1].route.shape[1] == 4
        assert c.get_plan(1).version == 1 and c.get_plan(42) is None
        load = np.random.default_rng(1).integers(0, 100, (R, E))
        res = c.solve(load, policy="static")
        assert res.plan.rank_tokens().sum() == load.sum() and len(core.versions()) == 3
        with pytest.raises(grpc.RpcError) as err:
            c.solve(load[:2])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            c.solve(load, policy="nope")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_rest_over_a_real_socket_and_restart_recovers_plans(tmp_path):
    db = str(tmp_path / "plans.sqlite")
    core = _core()
    settings = SurfaceSettings(rest_port=0, grpc_port=0, token=TOKEN, db_path=db)
    with Surfaces(core, settings) as s:
        for step in range(2):
            _step(core, step)
            core.commit(core.plan(step).version)
        r = httpx.get(f"{s.rest_url}/api/v1/plans/latest")
        assert r.status_code == 200 and r.json()["version"] == 2
        assert httpx.get(f"{s.rest_url}/api/v1/ready").json()["ready"] is True
        assert "expertmesh_plan_commits_total 2.0" in httpx.get(f"{s.rest_url}/metrics").text
    fresh = _core()
    with Surfaces(fresh, settings) as s:
        assert fresh.committed is not None and fresh.committed.version == 2
        page = httpx.get(f"{s.rest_url}/api/v1/plans").json()
        assert [p["version"] for p in page["items"]] == [2, 1]
        with grpc.insecure_channel(s.grpc_target) as ch:
            h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert h.status == health_pb2.HealthCheckResponse.SERVING


def test_public_bind_without_a_token_is_refused():
    with pytest.raises(ValueError, match="without a token"):
        Surfaces(_core(), SurfaceSettings(host="0.0.0.0", rest_port=0, grpc_port=0))
