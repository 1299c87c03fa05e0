"""Security properties on real loopback servers (docs/security.md): loopback by default,
tokens on writes (REST and gRPC), size limits on both, hostile strings in what the
dashboard shows rendered as text in a real headless Chromium."""

from __future__ import annotations

import socket
import time

import grpc
import httpx
import numpy as np
import pytest

from expertmesh.controller.core import ControllerCore, ControllerSettings
from expertmesh.controller.server import Surfaces
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.planner import ModelSpec, Topology
from expertmesh.planner.policy import _REGISTRY, register
from expertmesh.planner.static import StaticPolicy
from expertmesh.v1 import expertmesh_pb2 as pb
from expertmesh.v1 import expertmesh_pb2_grpc as pb_grpc

TOKEN = "security-token"
EVIL_DC = '<script>window.pwned = "dc"</script>'
EVIL_DC2 = "<img src=x onerror=\"window.pwned='img'\">"
EVIL_POLICY = "<img src=x onerror=\"window.pwned='policy'\">&amp;</td>"


def _core(policy: str = "static") -> ControllerCore:
    topo = Topology.from_dict(
        {
            "dcs": [
                {"name": EVIL_DC, "nodes": 1, "ranks_per_node": 2},
                {"name": EVIL_DC2, "nodes": 1, "ranks_per_node": 2},
            ],
            "slots_per_rank": {"masters": 2, "spare": 1},
        }
    )
    model = ModelSpec(num_layers=1, num_experts=8, top_k=2, hidden=16, ffn_hidden=8)
    return ControllerCore(
        topo, model, ControllerSettings(policy=policy, trigger={"mode": "every_step"})
    )


@pytest.fixture
def evil_policy():
    cls = type("EvilPolicy", (StaticPolicy,), {"name": EVIL_POLICY})
    register(cls)
    try:
        yield EVIL_POLICY
    finally:
        _REGISTRY.pop(EVIL_POLICY, None)


def test_hostile_names_reach_the_json_raw_and_the_page_as_text(browser, evil_policy, tmp_path):
    core = _core(evil_policy)
    settings = SurfaceSettings(rest_port=0, grpc_port=0, db_path=str(tmp_path / "p.sqlite"))
    with Surfaces(core, settings) as s:
        for step in range(2):
            core.report_layer(step, 0, np.full((4, 8), step + 1))
            core.commit(core.plan(step).version)
        # the JSON the dashboard reads carries the strings unchanged, as JSON strings
        r = httpx.get(f"{s.rest_url}/api/v1/dashboard")
        assert r.headers["content-type"].startswith("application/json")
        assert r.headers["x-content-type-options"] == "nosniff"
        d = r.json()
        assert d["policy"] == EVIL_POLICY and {x["name"] for x in d["dcs"]} == {EVIL_DC, EVIL_DC2}
        assert [p["policy"] for p in d["plans"]] == [EVIL_POLICY] * 2
        page = httpx.get(f"{s.rest_url}/")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp

        browser.navigate(f"{s.rest_url}/")
        browser.wait_for("Number(document.body.dataset.polls || 0) >= 1")
        browser.wait_for("document.querySelectorAll('#plans-table tbody tr').length >= 2")
        assert browser.eval("document.getElementById('kpi-policy').textContent") == EVIL_POLICY
        texts = browser.eval(
            "[...document.querySelectorAll('#dc-map g text')].map(t => t.textContent)"
        )
        assert EVIL_DC in texts and EVIL_DC2 in texts
        cells = browser.eval(
            "[...document.querySelectorAll('#plans-table tbody td')].map(t => t.textContent)"
        )
        assert EVIL_POLICY in cells
        # nothing was parsed as markup, nothing ran
        assert browser.eval("document.querySelectorAll('img').length") == 0
        assert browser.eval("[...document.scripts].every(s => s.src)")  # only the page's own
        assert browser.eval("window.pwned === undefined")


def _own_addresses() -> set[str]:
    """This machine's non-loopback IPv4 addresses (the source address of outbound routes)."""
    found = set()
    for probe in ("192.0.2.123", "10.255.255.254", "172.31.255.254"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            try:
                u.connect((probe, 9))  # UDP: no packet is sent
            except OSError:
                continue
            addr = u.getsockname()[0]
            if not addr.startswith("127.") and addr != "0.0.0.0":
                found.add(addr)
    return found


def test_surfaces_bind_loopback_unless_told_otherwise():
    assert SurfaceSettings().host == "127.0.0.1"
    core = _core()
    with Surfaces(core, SurfaceSettings(rest_port=0, grpc_port=0)) as s:
        assert s.rest_url.startswith("http://127.0.0.1:") and s.grpc_target.startswith("127.0.0.1:")
        # not reachable on another address of this machine
        others = _own_addresses()
        for addr in others:
            for port in (s.rest_port, s.grpc_port):
                with socket.socket() as sock:
                    sock.settimeout(2)
                    assert sock.connect_ex((addr, int(port))) != 0, (addr, port)
    with pytest.raises(ValueError, match="without a token"):
        Surfaces(_core(), SurfaceSettings(host="0.0.0.0", rest_port=0, grpc_port=0))


def test_writes_need_the_token_on_both_surfaces():
    core = _core()
    settings = SurfaceSettings(rest_port=0, grpc_port=0, token=TOKEN)
    with Surfaces(core, settings) as s, grpc.insecure_channel(s.grpc_target) as ch:
        report = {"step": 0, "layer": 0, "rank": 0, "load": [1] * 8}
        policy = {"policy": "static"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            assert (
                httpx.post(f"{s.rest_url}/api/v1/reports", json=report, headers=headers).status_code
                == 401
            )
            assert (
                httpx.put(f"{s.rest_url}/api/v1/policy", json=policy, headers=headers).status_code
                == 401
            )
        stub = pb_grpc.ExpertMeshServiceStub(ch)
        msg = pb.ReportLoadRequest(reports=[pb.LoadReport(step=0, layer=0, rank=0, load=[1] * 8)])
        for md in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            with pytest.raises(grpc.RpcError) as err:
                stub.ReportLoad(iter([msg]), metadata=md, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert not core.loads._pending and core.reports_rejected == core.reports_received == 6
        # reads need none; with the token the writes go through
        assert httpx.get(f"{s.rest_url}/api/v1/policy").status_code == 200
        ok = {"Authorization": f"Bearer {TOKEN}"}
        assert (
            httpx.post(f"{s.rest_url}/api/v1/reports", json=report, headers=ok).status_code == 200
        )
        resp = stub.ReportLoad(iter([msg.__class__(reports=[pb.LoadReport(step=0, layer=0, rank=1, load=[1] * 8)])]),
                               metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)  # fmt: skip
        assert resp.accepted == 1


def test_near_miss_tokens_are_refused_on_both_surfaces():
    """Longer, shorter, case-changed and empty tokens: 401 on REST, UNAUTHENTICATED on gRPC
    (a check that compares only a prefix lets one of them through); nothing is applied."""
    core = _core()
    settings = SurfaceSettings(rest_port=0, grpc_port=0, token=TOKEN)
    near = [TOKEN + "x", TOKEN + TOKEN, TOKEN[:-1], TOKEN[:1], TOKEN.upper(), ""]
    with Surfaces(core, settings) as s, grpc.insecure_channel(s.grpc_target) as ch:
        stub = pb_grpc.ExpertMeshServiceStub(ch)
        msg = pb.ReportLoadRequest(reports=[pb.LoadReport(step=0, layer=0, rank=0, load=[1] * 8)])
        report = {"step": 0, "layer": 0, "rank": 0, "load": [1] * 8}
        for sent in near:
            auth = {"Authorization": f"Bearer {sent}".rstrip()}  # httpx refuses "Bearer "
            r = httpx.post(f"{s.rest_url}/api/v1/reports", json=report, headers=auth)
            assert r.status_code == 401, sent
            r = httpx.put(f"{s.rest_url}/api/v1/policy", json={"policy": "static"}, headers=auth)
            assert r.status_code == 401, sent
            with pytest.raises(grpc.RpcError) as err:
                stub.ReportLoad(
                    iter([msg]), metadata=(("authorization", f"Bearer {sent}"),), timeout=10
                )
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, sent
        assert (
            not core.loads._pending
            and core.reports_rejected == core.reports_received == 2 * len(near)
        )
        # the control: the token itself goes through on both
        ok = (("authorization", f"Bearer {TOKEN}"),)
        assert stub.ReportLoad(iter([msg]), metadata=ok, timeout=10).accepted == 1


def test_size_limits_on_both_surfaces():
    core = _core()
    settings = SurfaceSettings(
        rest_port=0, grpc_port=0, token=TOKEN, max_body_bytes=64 * 1024, max_message_bytes=64 * 1024
    )
    with Surfaces(core, settings) as s, grpc.insecure_channel(s.grpc_target) as ch:
        ok = {"Authorization": f"Bearer {TOKEN}"}
        big = {"step": 0, "layer": 0, "rank": 0, "load": [1] * 40_000}
        r = httpx.post(f"{s.rest_url}/api/v1/reports", json=big, headers=ok)
        assert r.status_code == 413
        # oversized headers: refused by the HTTP parser, the server keeps serving
        try:
            r = httpx.get(f"{s.rest_url}/api/v1/health", headers={"x-big": "a" * 200_000})
            assert r.status_code in (400, 431)
        except httpx.HTTPError:
            pass  # the connection was closed on us: refused too
        assert httpx.get(f"{s.rest_url}/api/v1/health").status_code == 200
        stub = pb_grpc.ExpertMeshServiceStub(ch)
        msg = pb.ReportLoadRequest(reports=[pb.LoadReport(load=[2**40] * 20_000)])
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportLoad(
                iter([msg]), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10
            )
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as err:  # oversized metadata
            stub.GetPlan(pb.GetPlanRequest(), metadata=(("x-big", "a" * 100_000),), timeout=10)
        assert err.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetPlan(pb.GetPlanRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND  # still serving
        assert core.reports_received == core.reports_rejected == 1  # the 413; gRPC never read its


def test_open_grpc_calls_are_bounded():
    core = _core()
    settings = SurfaceSettings(rest_port=0, grpc_port=0, max_concurrent_rpcs=3)
    with Surfaces(core, settings) as s, grpc.insecure_channel(s.grpc_target) as ch:
        stub = pb_grpc.ExpertMeshServiceStub(ch)
        watchers = [stub.WatchPlans(pb.WatchPlansRequest()) for _ in range(3)]
        try:
            codes = set()
            # The watchers open asynchronously, racing the probes below for the three slots:
            # either a probe or a watcher is refused. Retry (bounded, ~10 s) until one is.
            for _ in range(100):
                codes |= {w.code() for w in watchers if w.done()}
                if grpc.StatusCode.RESOURCE_EXHAUSTED in codes:
                    break
                try:
                    stub.GetPlan(pb.GetPlanRequest(), timeout=5)
                except grpc.RpcError as err:
                    codes.add(err.code())
                time.sleep(0.1)
            assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes, codes
        finally:
            for w in watchers:
                w.cancel()
        for _ in range(50):  # the slots free up once the watchers are gone
            try:
                stub.GetPlan(pb.GetPlanRequest(), timeout=5)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    break
        else:
            raise AssertionError("the server did not serve again after the watchers left")
