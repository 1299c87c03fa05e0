import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from expertmesh.controller.core import ControllerCore, ControllerSettings
from expertmesh.planner import ModelSpec, Topology
from expertmesh.v1 import convert
from expertmesh.v1 import expertmesh_pb2 as pb


def _committed_plan():
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    model = ModelSpec(num_layers=2, num_experts=8, hidden=16, ffn_hidden=8)
    core = ControllerCore(topo, model, ControllerSettings(trigger={"mode": "every_step"}))
    rng = np.random.default_rng(0)
    for step in range(2):
        for layer in range(2):
            core.report_layer(step, layer, rng.integers(0, 50, (4, 8)))
        pv = core.commit(core.plan(step).version)
    return pv


def test_plan_round_trips_through_the_wire_format():
    pv = _committed_plan()
    wire = convert.plan_to_msg(pv, include_route=True).SerializeToString()
    got = convert.plan_from_msg(pb.Plan.FromString(wire))
    assert (got.version, got.step, got.policy, got.state) == (2, 1, "static", "committed")
    assert got.imbalance_after == pytest.approx(pv.imbalance_after)
    for a, b in zip(pv.layers, got.layers, strict=True):
        assert np.array_equal(a.phy2log, b.phy2log) and b.phy2log.dtype == np.int32
        assert np.array_equal(a.placement.master, b.placement.master)
        assert np.array_equal(a.route, b.route)
        assert a.migration.transfers == b.migration.transfers
    no_route = convert.plan_from_msg(convert.plan_to_msg(pv))
    assert no_route.layers[0].route.shape == (0, 4)


@given(
    step=st.integers(0, 2**40),
    layer=st.integers(0, 100),
    rank=st.integers(0, 5000),
    load=st.lists(st.integers(0, 2**40), max_size=64),
)
def test_reports_round_trip(step, layer, rank, load):
    msg = pb.ReportLoadRequest(reports=[convert.report_to_msg(step, layer, rank, np.array(load))])
    (r,) = convert.reports_from_msg(pb.ReportLoadRequest.FromString(msg.SerializeToString()))
    assert (r.step, r.layer, r.rank) == (step, layer, rank) and r.load.tolist() == load


@pytest.mark.parametrize("bad", [-1, 2**40 + 1, -(2**63)])
def test_reports_with_bad_counts_are_refused(bad):
    msg = pb.ReportLoadRequest(reports=[pb.LoadReport(load=[1, bad])])
    with pytest.raises(ValueError, match="counts"):
        convert.reports_from_msg(msg)


def test_too_many_reports_in_one_message_are_refused():
    msg = pb.ReportLoadRequest(reports=[pb.LoadReport()] * 5)
    with pytest.raises(ValueError, match="at most 4"):
        convert.reports_from_msg(msg, max_reports=4)


def _layer_msg(**kw):
    base = dict(layer=0, num_ranks=2, slots_per_rank=2, phy2log=[0, -1, 1, -1], master=[0, 2])
    base.update(kw)
    return pb.LayerPlan(**base)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"phy2log": [0, -1, 1]}, "R\\*S"),
        ({"num_ranks": 0}, "R\\*S"),
        ({"phy2log": [0, -1, 5, -1]}, "outside"),
        ({"master": [0, 9]}, "out of range"),
        ({"master": [1, 2]}, "does not hold"),
        ({"route": [1, 2, 3]}, "multiple of 4"),
        ({"migrations": [pb.Transfer()]}, "kind"),
    ],
)
def test_bad_layer_plans_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        convert.layer_plan_from_msg(_layer_msg(**kw))
    assert convert.layer_plan_from_msg(_layer_msg()).phy2log.shape == (2, 2)


def test_solve_args_round_trip_and_bad_requests():
    args = convert.SolveArgs(
        load=np.arange(6).reshape(2, 3), layer=1, policy="static", policy_settings={"a": 1}
    )
    back = convert.solve_args_from_msg(convert.solve_args_to_msg(args))
    assert np.array_equal(back.load, args.load) and back.policy_settings == {"a": 1}
    assert back.from_committed and back.layer == 1
    for kw, message in [
        ({"num_ranks": 2, "num_experts": 2, "load": [1, 2, 3]}, "not num_ranks"),
        ({"num_ranks": 1, "num_experts": 1, "load": [-5]}, "counts"),
        ({"num_ranks": 0, "num_experts": 0}, "not num_ranks"),
        ({"num_ranks": 1, "num_experts": 1, "load": [1], "policy_settings_json": "{"}, "JSON"),
        ({"num_ranks": 1, "num_experts": 1, "load": [1], "policy_settings_json": "[1]"}, "object"),
    ]:
        with pytest.raises(ValueError, match=message):
            convert.solve_args_from_msg(pb.SolveRequest(**kw))


@pytest.mark.parametrize(
    ("settings_json", "match"),
    [
        ("[" * 20_000 + "]" * 20_000, "nested too deeply"),
        ('{"period": NaN}', "finite"),
        ('{"cost": {"flops_per_second": Infinity}}', "finite"),
        ("[1]", "JSON object"),
    ],
)
def test_hostile_policy_settings_json_is_refused(settings_json, match):
    msg = pb.SolveRequest(num_ranks=1, num_experts=1, load=[1], policy_settings_json=settings_json)
    with pytest.raises(ValueError, match=match):
        convert.solve_args_from_msg(msg)
