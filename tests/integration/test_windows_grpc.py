"""Aggregated load over gRPC, as a trainer outside Ray sends it to `expertmesh serve`: one
DcAggregator per DC, ReportWindows over a real loopback server (with mutual TLS and a
token), serve's plan loop planning on the windows; refused reports counted, state kept."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from expertmesh.cli.serve import PlanLoop
from expertmesh.controller.certs import make_certs
from expertmesh.controller.core import ControllerCore, ControllerSettings, Trigger
from expertmesh.controller.server import Surfaces
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.planner import ModelSpec, Topology
from expertmesh.planner.window import WindowBlock, WindowReport
from expertmesh.v1 import convert
from expertmesh.v1 import expertmesh_pb2 as pb
from expertmesh.workers.aggregate import DcAggregator
from expertmesh.workers.client import ClientTls, ExpertMeshClient

TOKEN = "windows-token"
E, L, N = 8, 2, 5


def _core() -> ControllerCore:
    topo = Topology.generate(dcs=3, ranks_per_dc=2, masters=2, spare=1)
    settings = ControllerSettings(policy="eplb", trigger=Trigger(mode="every_step"))
    return ControllerCore(topo, ModelSpec(num_layers=L, num_experts=E, top_k=2), settings)


def test_serve_plans_on_dc_windows_sent_over_mutual_tls(tmp_path):
    make_certs(tmp_path, {"controller": [], "dc0": []})
    core = _core()
    topo = core.topology
    settings = SurfaceSettings(
        rest_port=0,
        grpc_port=0,
        token=TOKEN,
        tls_cert=tmp_path / "controller.pem",
        tls_key=tmp_path / "controller.key",
        tls_client_ca=tmp_path / "ca.pem",
    )
    tls = ClientTls(ca=tmp_path / "ca.pem", cert=tmp_path / "dc0.pem", key=tmp_path / "dc0.key")
    aggs = [DcAggregator(d, topo.dc_ranks[d].tolist(), L, E, N) for d in range(topo.num_dcs)]
    rng = np.random.default_rng(0)
    loads = rng.integers(0, 30, (2 * N, topo.num_ranks, L, E))
    with Surfaces(core, settings) as s, ExpertMeshClient(s.grpc_target, token=TOKEN, tls=tls) as c:
        loop = PlanLoop(core)
        accepted = completed = 0
        for t in range(2 * N):
            for agg in aggs:
                reps = [w for r in agg.ranks for w in agg.add_step(t, r, loads[t, r])]
                if reps:
                    a, done = c.report_windows(reps)
                    accepted, completed = accepted + a, completed + done
            loop.tick()
        assert (accepted, completed) == (2 * L * topo.num_dcs, 2 * L)
        # serve's loop planned and committed on the windows
        assert core.committed is not None and core.committed.step == 2 * N - 1
        for layer in range(L):
            newest = core.windows_in.newest(layer)
            want = loads[N:, :, layer].sum(axis=0)  # [R, E] over the second window
            assert np.array_equal(newest.dc_sum, np.stack([want[r].sum(0) for r in topo.dc_ranks]))
        sent = sum(a.reports_sent for a in aggs)
        assert sent == 2 * N * topo.num_ranks * L == core.windows_in.rank_reports
        # refusals: wrong token, a bad window (after a good one), garbage bytes
        w = core.windows_in
        before = (w.received, w.rejected, core.window(0).shape[0])
        good = WindowReport(
            first_step=2 * N, last_step=3 * N - 1, layer=0, dc=0, steps=N, reports=1,
            load=np.ones(E, np.int64),
        )  # fmt: skip
        with ExpertMeshClient(s.grpc_target, token="wrong", tls=tls) as wrong:
            with pytest.raises(grpc.RpcError) as err:
                wrong.report_windows([good])
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            c.report_windows([good, good])  # the second: a duplicate
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "already reported" in err.value.details()
        raw = c._channel.unary_unary(
            "/expertmesh.v1.ExpertMeshService/ReportWindows",
            request_serializer=lambda b: b,
            response_deserializer=pb.ReportWindowsResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff garbage", metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        msg = pb.ReportWindowsRequest(reports=[pb.WindowReport(layer=0, rows=2, load=[1, 2, 3])])
        with pytest.raises(grpc.RpcError) as err:
            raw(msg.SerializeToString(), metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # 1 (wrong token) + 2 (good applied, duplicate refused) + 1 (garbage) + 1 (rows)
        assert w.received == before[0] + 5
        assert w.rejected == before[1] + 4
        assert w.received == w.applied + w.rejected
        assert core.reports_received - core.reports_rejected == accepted + 1
        assert core.window(0).shape[0] == before[2]  # the pending window did not complete


def test_dc_window_blocks_packed_counts_and_the_old_format_side_by_side():
    """One DC's window of every layer as one DcWindowReport (counts as packed bytes), a
    WindowReport with packed counts, and the old varint form: the same sums; a bad block
    is refused whole (every layer counted), the state kept."""
    core = _core()
    topo = core.topology
    rng = np.random.default_rng(3)
    sums = rng.integers(0, 500, (topo.num_dcs, L, E))

    def reps(d: int) -> list[WindowReport]:
        return [
            WindowReport(first_step=0, last_step=N - 1, layer=layer, dc=d, steps=N,
                         reports=2 * N, load=sums[d, layer])
            for layer in range(L)
        ]  # fmt: skip

    auth = (("authorization", f"Bearer {TOKEN}"),)
    surf = SurfaceSettings(rest_port=0, grpc_port=0, token=TOKEN)
    with Surfaces(core, surf) as s, ExpertMeshClient(s.grpc_target, token=TOKEN) as c:
        raw = c._channel.unary_unary(
            "/expertmesh.v1.ExpertMeshService/ReportWindows",
            request_serializer=pb.ReportWindowsRequest.SerializeToString,
            response_deserializer=pb.ReportWindowsResponse.FromString,
        )
        assert c.report_windows(reps(0)) == (L, 0)  # one DcWindowReport
        assert c.report_windows(reps(1), blocks=False) == (L, 0)  # L varint WindowReports
        packed = [convert.window_to_msg(x, packed=True) for x in reps(2)]
        resp = raw(pb.ReportWindowsRequest(reports=packed[:1]), metadata=auth)
        assert (resp.accepted, resp.completed) == (1, 1)  # layer 0 complete
        w = core.windows_in
        before = (w.received, w.rejected)
        bad_blocks = [
            pb.DcWindowReport(first_step=0, last_step=N - 1, dc=2, rows=1, layers=[0, 1],
                              steps=[N, N], reports=[1, 1], counts=b"\x00" * 8),  # short
            pb.DcWindowReport(first_step=0, last_step=N - 1, dc=2, rows=1, layers=[0, 0],
                              steps=[N, N], reports=[1, 1], counts=b"\x00" * 16 * E),
            # layer 1 fine, layer 0 of DC 2 already reported: the whole block refused
            pb.DcWindowReport(first_step=0, last_step=N - 1, dc=2, rows=1, layers=[1, 0],
                              steps=[N, N], reports=[1, 1], counts=b"\x00" * 16 * E),
        ]  # fmt: skip
        for b in bad_blocks:
            with pytest.raises(grpc.RpcError) as err:
                raw(pb.ReportWindowsRequest(dc_windows=[b]), metadata=auth)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (w.received, w.rejected) == (before[0] + 6, before[1] + 6)
        assert core.window(1).shape[0] == 0  # nothing of the refused blocks applied
        resp = raw(pb.ReportWindowsRequest(reports=packed[1:]), metadata=auth)
        assert (resp.accepted, resp.completed) == (1, 1)
    for layer in range(L):
        assert np.array_equal(core.windows_in.newest(layer).dc_sum, sums[:, layer])
    assert w.received == w.applied + w.rejected and w.applied == 3 * L
    assert w.rank_reports == 3 * L * 2 * N


def test_packed_counts_of_every_width_as_an_outside_client_sends_them():
    """Messages built from the .proto's types alone (no expertmesh converter), counts packed
    little-endian at each CountWidth (unset: int64, the form before the field): the same
    sums; an unknown width or a byte count that does not fit the width is refused with
    INVALID_ARGUMENT, counted, and changes nothing."""
    core = _core()
    topo = core.topology
    rng = np.random.default_rng(8)
    sums = rng.integers(0, 250, (topo.num_dcs, L, E))
    sums[1] += 60_000  # DC 1 needs 16 bits
    sums[2, 1] += 2**33  # DC 2's layer 1 needs 64
    auth = (("authorization", f"Bearer {TOKEN}"),)
    surf = SurfaceSettings(rest_port=0, grpc_port=0, token=TOKEN)

    def block(d: int, dtype: str, width: int, *, layers=(0, 1), extra: bytes = b""):
        counts = sums[d, list(layers)].astype(dtype).tobytes() + extra
        return pb.DcWindowReport(first_step=0, last_step=N - 1, dc=d, rows=1,
                                 layers=list(layers), steps=[N] * len(layers),
                                 reports=[2 * N] * len(layers), counts=counts,
                                 count_width=width)  # fmt: skip

    with Surfaces(core, surf) as s, grpc.insecure_channel(s.grpc_target) as ch:
        call = ch.unary_unary(
            "/expertmesh.v1.ExpertMeshService/ReportWindows",
            request_serializer=pb.ReportWindowsRequest.SerializeToString,
            response_deserializer=pb.ReportWindowsResponse.FromString,
        )
        w = core.windows_in
        bad = [
            block(0, "<u1", 99),  # no such width
            block(0, "<u1", pb.COUNT_WIDTH_UINT8, extra=b"\0"),  # a byte too many
            block(0, "<u2", pb.COUNT_WIDTH_UINT8),  # 16-bit bytes called 8-bit
            block(1, "<u4", pb.COUNT_WIDTH_UINT16),
        ]
        for b in bad:
            with pytest.raises(grpc.RpcError) as err:
                call(pb.ReportWindowsRequest(dc_windows=[b]), metadata=auth)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (w.received, w.rejected, w.pending_dropped) == (2 * len(bad), 2 * len(bad), 0)
        assert core.window(0).shape[0] == 0
        good = [
            block(0, "<u1", pb.COUNT_WIDTH_UINT8),
            block(1, "<u2", pb.COUNT_WIDTH_UINT16),
            block(2, "<i8", pb.COUNT_WIDTH_UNSPECIFIED, layers=(0,)),
        ]
        resp = call(pb.ReportWindowsRequest(dc_windows=good), metadata=auth)
        assert (resp.accepted, resp.completed) == (5, 1)
        one = pb.WindowReport(first_step=0, last_step=N - 1, layer=1, dc=2, steps=N,
                              reports=2 * N, rows=1, counts=sums[2, 1].astype("<i8").tobytes(),
                              count_width=pb.COUNT_WIDTH_INT64)  # fmt: skip
        resp = call(pb.ReportWindowsRequest(reports=[one]), metadata=auth)
        assert (resp.accepted, resp.completed) == (1, 1)
    for layer in range(L):
        assert np.array_equal(core.windows_in.newest(layer).dc_sum, sums[:, layer])
    assert w.received == w.applied + w.rejected and w.applied == 3 * L
    # and the converter picks the narrowest width that holds a block
    msg = convert.windows_to_msg([WindowBlock(0, N - 1, 1, [0, 1], [N, N], [1, 1], sums[1])])
    assert msg.dc_windows[0].count_width == pb.COUNT_WIDTH_UINT16
    assert len(msg.dc_windows[0].counts) == 2 * L * E
