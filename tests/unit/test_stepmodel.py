"""The whole-step model of the runtime's schedule against hand-computed cases."""

import numpy as np
import pytest

from expertmesh.planner import ModelSpec, Placement, Topology
from expertmesh.planner.costmodel import CostSettings, step_cost
from expertmesh.planner.stepmodel import (
    SpmdCollectives,
    StepLayout,
    spmd_step_cost,
    step_layout,
    sync_hops,
    training_step_cost,
)
from expertmesh.planner.topology import DC, Link
from expertmesh.planner.traffic import even_traffic

# Two DCs of one rank each. WAN: 8 Gbit/s = 1e9 B/s, 10 ms. Node and NIC: no latency.
TOPO = Topology(
    dcs=(DC("a", 1, 1), DC("b", 1, 1)),
    masters_per_rank=1,
    spare_per_rank=1,
    intra_node=Link(8000, 0.0),
    intra_dc=Link(800, 0.0),
    inter_dc=Link(8, 10.0),
)
# a token is 2,000 bytes; P = 30,000 params; fp32 weights and gradients: 120,000 B per copy
MODEL = ModelSpec(
    num_layers=2, num_experts=2, top_k=1, hidden=1000, ffn_hidden=10, weight_bytes=4, grad_bytes=4
)
CS = CostSettings(flops_per_second=1e9)
STATIC = Placement(np.array([[0, -1], [1, -1]], np.int32), np.array([0, 2]))
REPLICA = Placement(np.array([[0, 1], [1, -1]], np.int32), np.array([0, 2]))  # 1 copied to a
LOAD = np.array([[0, 1000], [0, 0]])  # rank 0 sends 1,000 tokens to expert 1


def _traffic(placement):
    return even_traffic(LOAD, placement, TOPO, MODEL.top_k, domain="dc")


def test_static_step_is_the_layers_chains_plus_the_dense_exchange():
    t = training_step_cost(
        TOPO, MODEL, [_traffic(STATIC)] * 2, [STATIC] * 2, dense_params=1000, settings=CS
    )
    # per layer: dispatch 12 ms, compute 60 ms, combine 12 ms; backward 12 + 120 + 12 ms
    assert t.layers == pytest.approx([0.228, 0.228])
    assert t.compute == pytest.approx(2 * 0.180)
    # dense sums (4,000 B each way) cross in the gradient phase; nothing to refresh
    assert t.gradient == pytest.approx(0.010 + 4000 / 1e9)
    assert t.refresh == 0.0
    assert t.seconds == pytest.approx(2 * 0.228 + 0.010 + 4e-6)
    assert t.cross_dc_weight_bytes == pytest.approx(8000)
    assert t.cross_dc_token_bytes == pytest.approx(2 * 4 * 1000 * 2000)


def test_replicas_sync_in_their_own_phases():
    t = training_step_cost(TOPO, MODEL, [_traffic(REPLICA)] * 2, [REPLICA] * 2, settings=CS)
    assert t.cross_dc_token_bytes == 0
    assert t.layers == pytest.approx([0.180, 0.180])  # compute only
    # both layers' gradients (120,000 B each) a -> b, then both refreshes b -> a
    assert t.gradient == pytest.approx(0.010 + 240_000 / 1e9)
    assert t.refresh == pytest.approx(0.010 + 240_000 / 1e9)
    assert t.seconds == pytest.approx(0.360 + 2 * 0.01024)


def test_message_seconds_add_once_per_round() -> None:
    o = 0.002
    args = (TOPO, MODEL, [_traffic(REPLICA), _traffic(STATIC)], [REPLICA, STATIC])
    base = training_step_cost(*args, dense_params=10, settings=CS)
    cs = CS.model_copy(update={"message_seconds": o})
    t = training_step_cost(*args, dense_params=10, settings=cs)
    # begin 1; the replicated layer keeps its tokens home: 4 rounds, the static one relays
    # across DCs: 8; gradient 2; refresh 1 (no DC holds two copies: nothing fans out)
    assert t.seconds - base.seconds == pytest.approx((1 + 4 + 8 + 2 + 1) * o)
    assert t.messages == pytest.approx(16 * o)
    layer = step_cost(TOPO, MODEL, _traffic(STATIC), None, CS)
    assert t.layers[1] == pytest.approx(layer.seconds + 8 * o)
    full = training_step_cost(*args, dense_params=10, settings=cs, layout=StepLayout.full(2))
    assert full.seconds - base.seconds == pytest.approx(StepLayout.full(2).rounds * o)
    assert StepLayout.full(2).rounds == 21


def test_step_layout_of_a_plan() -> None:
    none = np.zeros((0, 4), np.int64)
    both = Placement(np.array([[0, 1], [1, 0]], np.int32), np.array([0, 2]))  # each DC: both
    assert step_layout([STATIC], [none], TOPO) == StepLayout((True,), False)
    assert step_layout([both], [none], TOPO) == StepLayout((False,), False)
    # a route row sending rank 0's tokens for expert 1 to rank 1 (the other DC) relays
    assert step_layout([both], [np.array([[0, 1, 1, 5]])], TOPO).relay == (True,)
    assert step_layout([both], [np.array([[0, 1, 1, 0]])], TOPO).relay == (False,)
    # rank 1 planned out: DC b takes no part, DC a holds everything
    live = np.array([True, False])
    assert step_layout([REPLICA], [none], TOPO, live) == StepLayout((False,), False)
    # two copies of an expert mastered elsewhere in one DC: the refresh fans out there
    topo = Topology.generate(2, 2, masters=1, spare=1)
    p = Placement(np.array([[0, 1], [1, -1], [2, 0], [3, 0]], np.int32), np.arange(4) * 2)
    assert step_layout([p], [none], topo).fanout
    assert StepLayout.full(1).covers(StepLayout((False,), False))
    assert not StepLayout((False,), True).covers(StepLayout((True,), False))
    with pytest.raises(ValueError, match="route"):
        step_layout([STATIC], [], TOPO)


def test_bad_arguments():
    with pytest.raises(ValueError, match="per layer"):
        training_step_cost(TOPO, MODEL, [_traffic(STATIC)], [STATIC])
    fwd = MODEL.model_copy(update={"training": False})
    with pytest.raises(ValueError, match="training"):
        training_step_cost(TOPO, fwd, [_traffic(STATIC)] * 2, [STATIC] * 2)
    accum = CostSettings(microbatches_per_update=2)
    with pytest.raises(ValueError, match="microbatches"):
        training_step_cost(TOPO, MODEL, [_traffic(STATIC)] * 2, [STATIC] * 2, settings=accum)
    with pytest.raises(ValueError, match="dense"):
        training_step_cost(TOPO, MODEL, [_traffic(STATIC)] * 2, [STATIC] * 2, dense_params=-1)
    chunks = CostSettings(pipeline_chunks=2)
    with pytest.raises(ValueError, match="pipeline"):
        training_step_cost(TOPO, MODEL, [_traffic(STATIC)] * 2, [STATIC] * 2, settings=chunks)
    with pytest.raises(ValueError, match="layout"):
        training_step_cost(
            TOPO, MODEL, [_traffic(STATIC)] * 2, [STATIC] * 2, layout=StepLayout.full(1)
        )


# ---- the SPMD plane's model ----


def test_spmd_collectives_count_the_layer_and_sync_exchanges():
    static = SpmdCollectives.of([True, True], num_dcs=2)
    # per layer 5 crossing + 5 in the DC; sync: 2 in the DC + 1 between leaders
    assert (static.total, static.crossing) == (23, 11)
    home = SpmdCollectives.of([False, False], num_dcs=2, hops=(True, True, True, True))
    assert (home.total, home.crossing) == (10 + 3 + 4, 1 + 2)
    fast = SpmdCollectives.of([False, True], microbatches=4, balance=True, fetch=[True, False])
    # microbatch: layer 0 5 + 1 + 2 in the DC; layer 1 5 + 1 in the DC, 5 crossing
    assert (fast.total, fast.crossing) == (4 * (8 + 11) + 3, 4 * 5 + 1)
    mig = SpmdCollectives.of([True], num_dcs=1, migration=3, migration_cross=2)
    assert (mig.total, mig.crossing) == (10 + 2 + 3, 5 + 2)
    with pytest.raises(ValueError, match="migration_cross"):
        SpmdCollectives.of([True], migration=1, migration_cross=2)


def test_sync_hops_follow_the_copies():
    assert sync_hops([STATIC], TOPO) == (False, False, False, False)
    assert sync_hops([REPLICA], TOPO) == (False, True, True, False)  # 1 copied to DC a
    two = Placement(np.array([[0, 1, 1], [1, -1, -1]], np.int32), np.array([0, 3]))
    big = Topology(
        dcs=(DC("a", 1, 1), DC("b", 1, 1)),
        masters_per_rank=1,
        spare_per_rank=2,
        inter_dc=Link(8, 10.0),
    )
    assert sync_hops([two], big) == (False, True, True, False)  # one rank: no in-DC hop


def test_spmd_step_cost_adds_compute_software_latency_and_the_busiest_pair():
    coll = SpmdCollectives(total=20, crossing=4)
    nbytes = np.array([[0.0, 2e6], [1e6, 0.0]])  # a -> b 2 MB at 1e9 B/s = 2 ms
    t = spmd_step_cost(
        TOPO, coll, nbytes, tokens_per_rank=1000, seconds_per_token=1e-5, collective_seconds=1e-3
    )
    assert t.compute == pytest.approx(0.01)
    assert t.software == pytest.approx(0.02)
    assert t.latency == pytest.approx(0.04)  # 4 crossings x 10 ms
    assert t.transfer == pytest.approx(0.002)
    assert t.seconds == pytest.approx(0.072)
    none = spmd_step_cost(
        TOPO, coll, np.zeros((2, 2)), tokens_per_rank=0, seconds_per_token=0, collective_seconds=0
    )
    assert none.seconds == pytest.approx(0.04)
    with pytest.raises(ValueError, match="pair_bytes"):
        spmd_step_cost(
            TOPO, coll, np.zeros(3), tokens_per_rank=0, seconds_per_token=0, collective_seconds=0
        )
