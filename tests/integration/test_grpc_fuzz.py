"""Hostile gRPC input against a real server on a free loopback port (hypothesis).

Each example opens a ``ReportLoad`` stream of good reports with at most one hostile
report among them (wrong length, negative, huge, unknown layer or rank, stale or absurd
step, duplicate), or a hostile ``Solve``/``GetPlan``. Properties:

- the call ends OK exactly when nothing hostile was sent, else with INVALID_ARGUMENT or
  RESOURCE_EXHAUSTED (never UNKNOWN/INTERNAL: no unhandled exception);
- counters reconcile: the server's received grows by the reports it read, applied
  (received - rejected) by the good reports before the hostile one, nothing else;
- the server keeps serving: a valid report and a health check succeed afterwards;
- partial loads stay bounded (``ControllerSettings.max_pending_steps`` per layer).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertmesh.controller.core import ControllerCore, ControllerSettings
from expertmesh.controller.server import Surfaces
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.planner import ModelSpec, Topology, available_policies
from expertmesh.v1 import expertmesh_pb2 as pb
from expertmesh.v1 import expertmesh_pb2_grpc as pb_grpc

TOKEN = "grpc-fuzz-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
R, E, L = 4, 8, 2
MAX_MESSAGE = 64 * 1024
EXAMPLES = int(os.environ.get("EXPERTMESH_FUZZ_EXAMPLES", "40"))
REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
U64 = 2**64 - 1
TRIED: dict[str, int] = {}  # hostile class -> examples sent


@dataclass
class Live:
    core: ControllerCore
    surfaces: Surfaces
    stub: pb_grpc.ExpertMeshServiceStub
    health: health_pb2_grpc.HealthStub
    next_step: int = 1


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    model = ModelSpec(num_layers=L, num_experts=E, top_k=2, hidden=16, ffn_hidden=8)
    core = ControllerCore(topo, model, ControllerSettings(trigger={"mode": "every_step"}))
    db = tmp_path_factory.mktemp("grpc-fuzz") / "plans.sqlite"
    cfg = SurfaceSettings(
        rest_port=0, grpc_port=0, token=TOKEN, db_path=str(db), max_message_bytes=MAX_MESSAGE
    )
    with Surfaces(core, cfg) as s, grpc.insecure_channel(s.grpc_target) as ch:
        rng = np.random.default_rng(0)
        for layer in range(L):  # step 0 complete and committed: plan 1 exists
            core.report_layer(0, layer, rng.integers(0, 50, (R, E)))
        core.commit(core.plan(0).version)
        live = Live(core, s, pb_grpc.ExpertMeshServiceStub(ch), health_pb2_grpc.HealthStub(ch))
        yield live
        out = os.environ.get("EXPERTMESH_GRPC_FUZZ_REPORT")  # figures for reliability.md
        if out:
            with open(out, "w") as f:
                json.dump(
                    {
                        "tried": TRIED,
                        "received": core.reports_received,
                        "rejected": core.reports_rejected,
                        "applied": _applied(core),
                    },
                    f,
                    indent=1,
                )


def _applied(core: ControllerCore) -> int:
    return core.reports_received - core.reports_rejected


def _good(step: int, layer: int, rank: int, value: int = 1) -> pb.LoadReport:
    return pb.LoadReport(step=step, layer=layer, rank=rank, load=[value] * E)


KINDS = [
    "short",
    "long",
    "empty",
    "negative",
    "huge_count",
    "unknown_layer",
    "unknown_rank",
    "stale_step",
    "absurd_step",
    "duplicate",
]


def _hostile(draw: Any, kind: str, step: int) -> tuple[str, pb.LoadReport]:
    layer = draw(st.integers(0, L - 1))
    rank = draw(st.integers(0, R - 1))
    load = [1] * E
    if kind == "short":
        load = draw(st.lists(st.integers(0, 100), min_size=1, max_size=E - 1))
    elif kind == "long":
        load = draw(st.lists(st.integers(0, 100), min_size=E + 1, max_size=4 * E))
    elif kind == "empty":
        load = []
    elif kind == "negative":
        load[draw(st.integers(0, E - 1))] = draw(st.integers(-(2**63), -1))
    elif kind == "huge_count":
        load[draw(st.integers(0, E - 1))] = draw(st.integers(2**40 + 1, 2**63 - 1))
    elif kind == "unknown_layer":
        layer = draw(st.integers(L, 2**32 - 1))
    elif kind == "unknown_rank":
        rank = draw(st.integers(R, 2**32 - 1))
    elif kind == "stale_step":
        return kind, pb.LoadReport(step=0, layer=layer, rank=rank, load=load)  # 0 is complete
    elif kind == "absurd_step":
        return kind, pb.LoadReport(
            step=draw(st.integers(2**62, U64)), layer=layer, rank=rank, load=load
        )
    return kind, pb.LoadReport(step=step, layer=layer, rank=rank, load=load)


@st.composite
def report_streams(draw: Any, live: Live, kind: str) -> tuple[str, list[list[pb.LoadReport]], int]:
    """(hostile class or "none", messages, index of the hostile report in the flat order)."""
    step = live.next_step
    live.next_step += 1
    # good reports: distinct (layer, rank) of this fresh step; sometimes a whole step
    pairs = [(layer, rank) for layer in range(L) for rank in range(R)]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs)))
    reports = [_good(step, layer, rank, draw(st.integers(0, 1000))) for layer, rank in chosen]
    bad_at = -1
    if kind != "none":
        kind, bad = _hostile(draw, kind, step)
        if kind == "duplicate":  # a copy of a good report, after it
            if not reports:
                reports = [_good(step, 0, 0)]
            bad = reports[draw(st.integers(0, len(reports) - 1))]
            bad_at = len(reports)
        else:
            bad_at = draw(st.integers(0, len(reports)))
        reports.insert(bad_at, bad)
    # split into messages
    cuts = sorted(draw(st.lists(st.integers(0, len(reports)), max_size=3)))
    messages, prev = [], 0
    for c in [*cuts, len(reports)]:
        messages.append(reports[prev:c])
        prev = c
    messages = [m for m in messages if m] or [[]]
    return kind, messages, bad_at


def _call(live: Live, messages: list[list[pb.LoadReport]]) -> tuple[grpc.StatusCode, Any]:
    try:
        resp = live.stub.ReportLoad(
            iter([pb.ReportLoadRequest(reports=m) for m in messages]), metadata=AUTH, timeout=30
        )
    except grpc.RpcError as err:
        return err.code(), err
    return grpc.StatusCode.OK, resp


def _still_serving(live: Live) -> None:
    h = live.health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert h.status == health_pb2.HealthCheckResponse.SERVING
    step = live.next_step
    live.next_step += 1
    before = _applied(live.core)
    resp = live.stub.ReportLoad(
        iter([pb.ReportLoadRequest(reports=[_good(step, 0, 0)])]), metadata=AUTH, timeout=30
    )
    assert resp.accepted == 1 and _applied(live.core) == before + 1


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize("kind", ["none", *KINDS])
def test_hostile_report_streams(live: Live, kind: str) -> None:
    """The properties above for every example of one class; then the class's coverage, from
    this test's own examples (it holds when the test runs alone): streams of several
    messages were sent and, for a hostile class, a hostile report after good ones."""
    shapes: list[tuple[int, int]] = []  # (messages, index of the hostile report)

    @FUZZ
    @given(data=st.data())
    def examples(data: st.DataObject) -> None:
        shapes.append(_report_stream_example(live, kind, data))

    examples()
    assert shapes, f"no {kind} example ran"
    assert any(n > 1 for n, _ in shapes), f"{kind}: every stream was one message"
    if kind != "none":
        assert any(bad > 0 for _, bad in shapes), f"{kind}: the hostile report always came first"


def _report_stream_example(live: Live, kind: str, data: st.DataObject) -> tuple[int, int]:
    kind, messages, bad_at = data.draw(report_streams(live, kind))
    TRIED[kind] = TRIED.get(kind, 0) + 1
    core = live.core
    received, applied = core.reports_received, _applied(core)
    windows = [core.layer_newest_step(layer) for layer in range(L)]
    code, resp = _call(live, messages)
    flat = [r for m in messages for r in m]
    if kind == "none":
        assert code == grpc.StatusCode.OK, resp
        assert resp.accepted == len(flat)
        assert core.reports_received == received + len(flat)
        assert _applied(core) == applied + len(flat)
    else:
        assert code in REFUSED, (kind, code, resp)
        assert resp.details()
        # the server read every message up to the one holding the hostile report
        read, seen = 0, 0
        for m in messages:
            read += len(m)
            seen += len(m)
            if seen > bad_at:
                break
        assert core.reports_received == received + read, (kind, messages, bad_at)
        assert _applied(core) == applied + bad_at, kind
    # no complete step appeared except from good reports of the fresh step
    for layer in range(L):
        newest = core.layer_newest_step(layer)
        assert newest == windows[layer] or newest == live.next_step - 1
    assert len(core.loads._pending) <= L * core.settings.max_pending_steps
    _still_serving(live)
    return len(messages), bad_at


def test_oversized_messages_and_batches_are_refused(live: Live) -> None:
    core = live.core
    received = core.reports_received
    big = pb.ReportLoadRequest(reports=[pb.LoadReport(step=live.next_step, load=[2**40] * 20_000)])
    assert big.ByteSize() > MAX_MESSAGE
    code, _ = _call(live, [list(big.reports)])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert core.reports_received == received  # the transport refused it: never read
    many = [pb.LoadReport(step=1)] * 5000  # small enough for the transport, too many
    code, _ = _call(live, [many])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert core.reports_received == received + 5000 and core.reports_rejected >= 5000
    _still_serving(live)


def test_far_future_steps_cannot_grow_memory(live: Live) -> None:
    """Partial loads of steps nobody completes are bounded per layer (oldest dropped)."""
    core = live.core
    base = live.next_step + 10_000
    dropped = core.pending_dropped
    extra = 20
    for i in range(core.settings.max_pending_steps + extra):
        code, _ = _call(live, [[_good(base + i, 1, 0)]])
        assert code == grpc.StatusCode.OK
    assert sum(1 for k in core.loads._pending if k[1] == 1) == core.settings.max_pending_steps
    assert core.pending_dropped >= dropped + extra
    assert (base, 1) not in core.loads._pending  # the oldest went first
    live.next_step = base + core.settings.max_pending_steps + extra
    # completing a newer step frees the older partial loads of the layer
    code, resp = _call(live, [[_good(live.next_step, 1, r) for r in range(R)]])
    assert code == grpc.StatusCode.OK and resp.completed == 1
    assert sum(1 for k in core.loads._pending if k[1] == 1) == 0
    live.next_step += 1
    _still_serving(live)


settings_values = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.booleans(),
    st.none(),
    st.lists(st.floats(allow_nan=True), max_size=4),
)


SOLVE_KINDS = ["none", "shape", "negative", "huge", "layer", "policy", "settings", "json", "deep"]


@st.composite
def solve_requests(draw: Any, kind: str) -> tuple[str, pb.SolveRequest]:
    load = np.arange(R * E) % 7
    req = pb.SolveRequest(layer=0, num_ranks=R, num_experts=E, load=load.tolist())
    if kind == "shape":
        req.num_ranks = draw(st.integers(0, 2**32 - 1))
        req.num_experts = draw(st.integers(0, 2**32 - 1))
        if req.num_ranks == R and req.num_experts == E:
            req.num_ranks = R + 1
    elif kind == "negative":
        req.load[draw(st.integers(0, R * E - 1))] = draw(st.integers(-(2**63), -1))
    elif kind == "huge":
        req.load[draw(st.integers(0, R * E - 1))] = draw(st.integers(2**40 + 1, 2**63 - 1))
    elif kind == "layer":
        req.layer = draw(st.integers(L, 2**32 - 1))
    elif kind == "policy":
        req.policy = draw(
            st.text(min_size=1, max_size=80).filter(lambda p: p not in available_policies())
        )
    elif kind in ("settings", "none"):
        req.policy = draw(st.sampled_from(sorted(available_policies())))
        if kind == "settings":
            keys = st.sampled_from(
                [
                    "period",
                    "window",
                    "num_groups",
                    "hierarchical",
                    "max_shadows",
                    "rounds",
                    "fill",
                    "move_masters",
                    "cost",
                    "encoding",
                    "x",
                ]
            )
            sub = st.dictionaries(
                st.sampled_from(
                    ["flops_per_second", "pipeline_chunks", "weight_bytes", "changed_fraction"]
                ),
                settings_values,
            )
            value = st.one_of(settings_values, sub)
            req.policy_settings_json = json.dumps(draw(st.dictionaries(keys, value, min_size=1)))
    elif kind == "json":
        req.policy_settings_json = draw(
            st.sampled_from(["[1]", "nul", "{", '"x"', "1e999", '{"a": NaN}'])
        )
    elif kind == "deep":
        depth = draw(st.integers(1000, 30_000))
        req.policy_settings_json = "[" * depth + "]" * depth
    return kind, req


@pytest.mark.parametrize("solve_kind", SOLVE_KINDS)
def test_hostile_solve_requests(live: Live, solve_kind: str) -> None:
    """Every example of one class is answered OK (valid) or refused, nothing changes, the
    server keeps serving; the class ran, and hostile settings were refused at least once."""
    codes: list[grpc.StatusCode] = []

    @settings(FUZZ, max_examples=max(1, EXAMPLES // 2))
    @given(data=st.data())
    def examples(data: st.DataObject) -> None:
        codes.append(_solve_example(live, solve_kind, data))

    examples()
    assert codes, f"no {solve_kind} example ran"
    if solve_kind == "settings":
        assert set(codes) & REFUSED, "no hostile settings were refused"


def _solve_example(live: Live, solve_kind: str, data: st.DataObject) -> grpc.StatusCode:
    kind, req = data.draw(solve_requests(solve_kind))
    TRIED[f"solve_{kind}"] = TRIED.get(f"solve_{kind}", 0) + 1
    versions = [pv.version for pv in live.core.versions()]
    policy = live.core.settings
    try:
        resp = live.stub.Solve(req, metadata=AUTH, timeout=60)
        code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        code, resp = err.code(), err
    if kind == "none":
        assert code == grpc.StatusCode.OK, resp
        assert sum(resp.plan.route[3::4]) == sum(req.load)
    elif kind == "settings":
        assert code in REFUSED | {grpc.StatusCode.OK}, resp
    else:
        assert code in REFUSED, (kind, code, resp)
    assert [pv.version for pv in live.core.versions()] == versions and live.core.settings == policy
    _still_serving(live)
    return code


@pytest.mark.parametrize("version", [2, 10**6, 2**62, 2**63, U64])
def test_unknown_plan_versions_are_not_found(live: Live, version: int) -> None:
    TRIED["get_plan_unknown"] = TRIED.get("get_plan_unknown", 0) + 1
    with pytest.raises(grpc.RpcError) as err:
        live.stub.GetPlan(pb.GetPlanRequest(version=version), metadata=AUTH, timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert live.stub.GetPlan(pb.GetPlanRequest(version=1), timeout=10).plan.version == 1


def test_reports_need_the_token(live: Live) -> None:
    core = live.core
    received, applied = core.reports_received, _applied(core)
    for metadata in [(), (("authorization", "Bearer nope"),), (("authorization", TOKEN),)]:
        with pytest.raises(grpc.RpcError) as err:
            live.stub.ReportLoad(
                iter([pb.ReportLoadRequest(reports=[_good(live.next_step, 0, 0)])]),
                metadata=metadata,
                timeout=10,
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert core.reports_received == received + 3 and _applied(core) == applied
