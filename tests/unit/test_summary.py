import numpy as np
import pytest

from expertmesh.planner import (
    ModelSpec,
    Topology,
    available_policies,
    imbalance,
    make_policy,
    plan_trace,
    straggler,
)
from expertmesh.planner.summary import summarize_plan
from expertmesh.planner.trace import TraceSettings, generate_trace


def trace(steps: int = 3, drift: float = 0.0) -> np.ndarray:
    s = TraceSettings(num_ranks=8, num_experts=16, num_layers=2, num_steps=steps, top_k=2,
                      tokens_per_rank=512, imbalance=2.0, drift=drift, seed=2)  # fmt: skip
    return generate_trace(s).load


def test_balance_figures_match_the_layer_plans():
    load = trace()
    topo = Topology.generate(dcs=2, ranks_per_dc=4, masters=2, spare=1)
    model = ModelSpec(num_experts=16, num_layers=2, top_k=2)
    plan = plan_trace(load, topo, model, make_policy("static"))
    s = summarize_plan(plan.to_arrays(), load, topo, model)
    for t in range(3):
        for layer in range(2):
            per_rank = plan.layers[t][layer].rank_tokens()
            assert s.imbalance[t, layer] == pytest.approx(imbalance(per_rank))
            assert s.straggler[t, layer] == pytest.approx(straggler(per_rank))
    # static EP *is* the static baseline
    np.testing.assert_allclose(s.static_imbalance, s.imbalance)
    assert (s.copies == 0).all() and (s.migrated_bytes == 0).all()
    assert (s.cross_dc_token_bytes > 0).all() and (s.step_seconds > 0).all()


def test_cross_dc_bytes_follow_the_topology_and_training():
    load = trace()
    model = ModelSpec(num_experts=16, num_layers=2, top_k=2)
    one = Topology.generate(dcs=1, ranks_per_dc=8, masters=2, spare=1)
    two = Topology.generate(dcs=2, ranks_per_dc=4, masters=2, spare=1)
    static = make_policy("static")
    s1 = summarize_plan(plan_trace(load, one, model, static).to_arrays(), load, one, model)
    assert (s1.cross_dc_bytes == 0).all()
    arrays = plan_trace(load, two, model, static).to_arrays()
    train = summarize_plan(arrays, load, two, model)
    infer = ModelSpec(num_experts=16, num_layers=2, top_k=2, training=False)
    fwd = summarize_plan(arrays, load, two, infer)
    # dispatch + combine, twice when training
    np.testing.assert_allclose(train.cross_dc_token_bytes, 2 * fwd.cross_dc_token_bytes)
    # a file without masters: the first copy stands in (static has no replicas)
    no_master = {k: v for k, v in arrays.items() if k != "master"}
    np.testing.assert_allclose(
        summarize_plan(no_master, load, two, model).step_seconds, train.step_seconds
    )


def test_migration_figures_sum_the_transfers():
    if "eplb" not in available_policies():
        pytest.skip("eplb not registered")
    load = trace(steps=6, drift=0.3)
    topo = Topology.generate(dcs=2, ranks_per_dc=4, masters=2, spare=2)
    model = ModelSpec(num_experts=16, num_layers=2, top_k=2)
    plan = plan_trace(load, topo, model, make_policy("eplb", {"period": 1, "window": 1}))
    s = summarize_plan(plan.to_arrays(), load, topo, model)
    copies = np.array([[lp.migration.copies for lp in row] for row in plan.layers])
    nbytes = np.array([[lp.migration.nbytes for lp in row] for row in plan.layers])
    assert copies.sum() > 0
    assert np.array_equal(s.copies, copies)
    np.testing.assert_allclose(s.migrated_bytes, nbytes)
    rank_dc = topo.rank_dc
    cross = np.zeros((6, 2))
    for t, row in enumerate(plan.layers):
        for layer, lp in enumerate(row):
            cross[t, layer] = sum(
                x.nbytes for x in lp.migration.transfers
                if rank_dc[x.src_rank] != rank_dc[x.dst_rank]
            )  # fmt: skip
    # weight bytes across DCs: at least the migrations that cross (plus replica sync)
    assert (s.cross_dc_weight_bytes >= cross - 1e-6).all()
