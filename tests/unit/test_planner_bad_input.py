"""The planner's public entry points refuse bad arguments with ValueError (never IndexError,
TypeError or a silent wrong answer): every registered policy through ``plan_layer``, the
migration functions, ``plan_trace`` and the settings of every policy."""

import numpy as np
import pytest

from expertmesh.planner import (
    ModelSpec,
    PolicyContext,
    Topology,
    available_policies,
    make_policy,
    plan_layer,
    plan_trace,
)
from expertmesh.planner.migration import align_placement, plan_migration
from expertmesh.planner.plan import Placement

R, E = 4, 8
TOPO = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
MODEL = ModelSpec(num_layers=1, num_experts=E, top_k=2, hidden=16, ffn_hidden=8)
GOOD = np.arange(R * E, dtype=np.int64).reshape(R, E) % 5


def _ctx(load=GOOD, history=None, previous=None, topology=TOPO, model=MODEL):
    if history is None:
        history = np.zeros((0, R, E), np.int64)
    return PolicyContext(
        topology=topology, model=model, step=1, layer=0, load=load, history=history,
        previous=previous,
    )  # fmt: skip


def _previous():
    return plan_layer(make_policy("static"), _ctx())


BAD_CONTEXTS = {
    "load_1d": dict(load=GOOD.ravel()),
    "load_3d": dict(load=GOOD[None]),
    "load_too_few_ranks": dict(load=GOOD[:2]),
    "load_too_many_experts": dict(load=np.ones((R, E + 3), np.int64)),
    "load_negative": dict(load=-GOOD - 1),
    "load_float_nan": dict(load=np.full((R, E), np.nan)),
    "load_float": dict(load=GOOD.astype(float) + 0.5),
    "load_object": dict(load=np.array([[object()] * E] * R, dtype=object)),
    "history_2d": dict(history=GOOD),
    "history_wrong_ranks": dict(history=np.ones((3, R + 1, E), np.int64)),
    "history_negative": dict(history=-np.ones((2, R, E), np.int64)),
    "model_experts_differ": dict(
        model=ModelSpec(num_layers=1, num_experts=E + 1, top_k=2, hidden=16, ffn_hidden=8)
    ),
}


@pytest.mark.parametrize("policy", available_policies())
@pytest.mark.parametrize("bad", sorted(BAD_CONTEXTS))
def test_every_policy_refuses_bad_contexts(policy, bad):
    with pytest.raises(ValueError):
        plan_layer(make_policy(policy), _ctx(**BAD_CONTEXTS[bad]))


@pytest.mark.parametrize("policy", available_policies())
def test_every_policy_refuses_a_previous_plan_of_another_shape(policy):
    other = Topology.generate(dcs=2, ranks_per_dc=3, masters=2, spare=1)
    load = np.ones((6, E), np.int64)
    history = np.zeros((0, 6, E), np.int64)
    prev = plan_layer(make_policy("static"), _ctx(load=load, history=history, topology=other))
    with pytest.raises(ValueError):
        plan_layer(make_policy(policy), _ctx(previous=prev))


@pytest.mark.parametrize("policy", available_policies())
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, 2**70, "x", [1], {"a": 1}])
def test_every_policy_refuses_bad_settings(policy, value):
    fields = make_policy(policy).Settings.model_fields
    key = next(iter(fields), "no_such_setting")
    with pytest.raises(ValueError):
        make_policy(policy, {key: value, **({} if fields else {"x": 1})})
    with pytest.raises(ValueError):
        make_policy(policy, {"no_such_setting": value})


def test_plan_trace_refuses_bad_traces():
    pol = make_policy("static")
    for bad in [GOOD, GOOD[None, None].astype(float), -GOOD[None, None], GOOD[None, None, :2]]:
        with pytest.raises(ValueError):
            plan_trace(bad, TOPO, MODEL, pol)


def test_migration_refuses_placements_of_different_shapes():
    old = _previous().placement
    wide = Placement(phy2log=np.full((R, TOPO.slots_per_rank + 1), -1, np.int32), master=old.master)
    short = Placement(phy2log=old.phy2log[:2], master=old.master)
    for new in (wide, short):
        with pytest.raises(ValueError):
            plan_migration(old, new, TOPO, MODEL)
        with pytest.raises(ValueError):
            align_placement(old, new, TOPO)
