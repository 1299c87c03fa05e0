"""gRPC as an outside client drives it: raw bytes over a real channel, the token's scheme,
server reflection (what grpcurl needs without ``-proto``)."""

from __future__ import annotations

import logging

import grpc
import httpx
import numpy as np
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from expertmesh.controller.server import Surfaces
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.v1 import expertmesh_pb2 as pb

from .test_surfaces import E, L, R, _core  # the same small controller

TOKEN = "edge-token"
SERVICE = "/expertmesh.v1.ExpertMeshService"
# Not protobuf: field 1 declared as 100 bytes long with 3 present; a tag with field number 0.
GARBAGE = (b"\x0a\x64abc", b"\x00\x01\x02", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")


@pytest.fixture
def live(tmp_path):
    core = _core()
    settings = SurfaceSettings(
        rest_port=0, grpc_port=0, token=TOKEN, db_path=str(tmp_path / "plans.sqlite")
    )
    with Surfaces(core, settings) as s, grpc.insecure_channel(s.grpc_target) as ch:
        rng = np.random.default_rng(0)
        for layer in range(L):
            core.report_layer(0, layer, rng.integers(0, 50, (R, E)))
        core.commit(core.plan(0).version)
        yield core, s, ch


def _raw(ch: grpc.Channel, method: str, kind: str, payload: bytes) -> grpc.RpcError:
    """Send ``payload`` as the request bytes of ``method`` (no serializer: bytes as they are)."""
    path = f"{SERVICE}/{method}"
    with pytest.raises(grpc.RpcError) as err:
        if kind == "unary":
            ch.unary_unary(path)(payload, timeout=10)
        elif kind == "server_stream":
            list(ch.unary_stream(path)(payload, timeout=10))
        else:
            ch.stream_unary(path)(
                iter([payload]), timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),)
            )
    return err.value


@pytest.mark.parametrize(
    ("method", "kind"),
    [("GetPlan", "unary"), ("Solve", "unary"), ("WatchPlans", "server_stream"), ("ReportLoad", "client_stream")],
)  # fmt: skip
def test_garbage_bytes_are_invalid_argument_one_line_and_counted(live, caplog, method, kind):
    core, _, ch = live
    for payload in GARBAGE:
        received, rejected = core.reports_received, core.reports_rejected
        version = core.committed.version
        caplog.clear()
        with caplog.at_level(logging.INFO):
            err = _raw(ch, method, kind, payload)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (payload, err.details())
        assert "not a valid" in err.details()
        ours = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(ours) == 1, [r.getMessage() for r in ours]
        assert ours[0].levelno == logging.WARNING and ours[0].exc_info is None
        assert method in ours[0].getMessage()
        counted = 1 if method == "ReportLoad" else 0
        assert (core.reports_received, core.reports_rejected) == (
            received + counted,
            rejected + counted,
        )
        assert core.committed.version == version and not core.loads._pending
    # and it keeps serving: a valid message over the same raw channel
    ok = ch.unary_unary(f"{SERVICE}/GetPlan")(b"", timeout=10)
    assert isinstance(ok, bytes) and ok


def test_bearer_scheme_is_case_insensitive_on_both_surfaces(live):
    _, s, ch = live
    report = ch.stream_unary(f"{SERVICE}/ReportLoad")
    step = 10
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        header = f"{scheme} {TOKEN}"
        msg = pb.ReportLoadRequest(
            reports=[pb.LoadReport(step=step, layer=0, rank=0, load=[1] * E)]
        )
        got = pb.ReportLoadResponse.FromString(
            report(
                iter([msg.SerializeToString()]), metadata=(("authorization", header),), timeout=10
            )
        )
        assert got.accepted == 1, scheme
        body = {"step": step, "layer": 0, "rank": 1, "load": [1] * E}
        r = httpx.post(f"{s.rest_url}/api/v1/reports", json=body, headers={"Authorization": header})
        assert r.status_code == 200, (scheme, r.text)
        step += 1
    for header in (f"Basic {TOKEN}", f"Bearer{TOKEN}", f"Bearer {TOKEN}x", "Bearer", TOKEN):
        msg = pb.ReportLoadRequest(
            reports=[pb.LoadReport(step=step, layer=0, rank=0, load=[1] * E)]
        )
        with pytest.raises(grpc.RpcError) as err:
            report(
                iter([msg.SerializeToString()]), metadata=(("authorization", header),), timeout=10
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, header
        body = {"step": step, "layer": 0, "rank": 1, "load": [1] * E}
        r = httpx.post(f"{s.rest_url}/api/v1/reports", json=body, headers={"Authorization": header})
        assert r.status_code == 401, header


def test_server_reflection_describes_the_service(live):
    core, _, ch = live
    db = ProtoReflectionDescriptorDatabase(ch)
    services = set(db.get_services())
    assert {"expertmesh.v1.ExpertMeshService", "grpc.health.v1.Health"} <= services
    pool = descriptor_pool.DescriptorPool(db)  # only what the server told us
    svc = pool.FindServiceByName("expertmesh.v1.ExpertMeshService")
    assert {m.name for m in svc.methods} == {
        "ReportLoad",
        "WatchPlans",
        "GetPlan",
        "Solve",
        "ReportWindows",
    }
    get_plan = svc.FindMethodByName("GetPlan")
    request_cls = message_factory.GetMessageClass(get_plan.input_type)
    response_cls = message_factory.GetMessageClass(get_plan.output_type)
    raw = ch.unary_unary(f"{SERVICE}/GetPlan")(request_cls().SerializeToString(), timeout=10)
    plan = response_cls.FromString(raw).plan
    assert plan.version == core.committed.version
