import numpy as np
import pytest

from expertmesh.planner import ModelSpec, Topology, check_layer_plan, make_policy, plan_trace
from expertmesh.planner.static import static_placement


def test_static_spreads_masters_evenly():
    p = static_placement(num_ranks=4, slots_per_rank=3, num_experts=8, masters_per_rank=2)
    assert p.phy2log.tolist() == [[0, 1, -1], [2, 3, -1], [4, 5, -1], [6, 7, -1]]
    assert p.master_rank().tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_static_refuses_too_many_experts():
    with pytest.raises(ValueError, match="do not fit"):
        static_placement(num_ranks=2, slots_per_rank=3, num_experts=5, masters_per_rank=2)


def test_static_plan_routes_everything_to_the_only_copy():
    topo = Topology.generate(dcs=2, ranks_per_dc=4, masters=2, spare=1)
    model = ModelSpec(num_experts=16, num_layers=2)
    load = np.random.default_rng(1).integers(0, 50, size=(3, 2, 8, 16))
    plan = plan_trace(load, topo, model, make_policy("static"))
    for t in range(3):
        for layer in range(2):
            lp = plan.layers[t][layer]
            check_layer_plan(lp, load[t, layer], topo.slots_per_rank)
            assert lp.migration.copies == 0
    assert np.array_equal(
        plan.layers[2][1].rank_tokens(), load[2, 1].reshape(8, 8, 2).sum(axis=(0, 2))
    )


def test_unknown_policy_is_a_value_error():
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope")
