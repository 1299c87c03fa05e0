"""The SPMD step model (planner/stepmodel.py) against hand-computed cases."""

import numpy as np
import pytest

from expertmesh.planner import ModelSpec, Placement, Topology
from expertmesh.planner.costmodel import CostSettings
from expertmesh.planner.stepmodel import SpmdCollectives, spmd_step_cost, sync_hops
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
    # a background switch: gradients from the old holders to the new plan's masters, fresh
    # weights to the new plan's holders; expert 1's master moves to rank 0 (DC a), where
    # static had no copy of it: its gradient crosses from b, its weights go nowhere
    moved = Placement(np.array([[0, 1], [-1, -1]], np.int32), np.array([0, 1]))
    assert sync_hops([STATIC], TOPO, [moved]) == (False, True, False, False)
    assert sync_hops([STATIC], TOPO, [REPLICA]) == (False, False, True, False)
    assert sync_hops([REPLICA], TOPO, [STATIC]) == (False, True, False, False)


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
    # per collective: each its busiest pair, summed (a -> b 2 ms then b -> a 1 ms: 3 ms)
    split = np.array([[[0.0, 2e6], [0.0, 0.0]], [[0.0, 0.0], [1e6, 0.0]]])
    per = spmd_step_cost(
        TOPO, coll, split, tokens_per_rank=0, seconds_per_token=0, collective_seconds=0
    )
    assert per.transfer == pytest.approx(0.003)


def test_spmd_collectives_fast_loop_split_by_dc_crosses_and_fused_drops_the_sizes_exchange():
    """Per microbatch and layer with the fast loop (``MoELayer``): the counts all-gather is
    in the DC unless the layer splits crossing tokens by DC (``spread``), where it runs over
    the world and crosses; ``fused``, it also stands in for the bundle sizes exchange."""

    def one(**kw):
        c = SpmdCollectives.of([True], num_dcs=2, balance=True, **kw)
        return c.total - 3, c.crossing - 1  # less the per-step dense sum, broadcast, leaders

    assert one() == (11, 5)  # 5 crossing + 5 in the DC + the DC's counts all-gather
    assert one(spread=[True]) == (11, 6)  # the all-gather crosses, sizes still exchanged
    assert one(spread=[True], fused=True) == (10, 5)  # the all-gather is the sizes exchange
    no_cross = SpmdCollectives.of([False], num_dcs=2, balance=True, spread=[True], fused=True)
    assert (no_cross.total - 3, no_cross.crossing - 1) == (6, 0)  # nothing crosses: no split
    off = SpmdCollectives.of([True], num_dcs=2, balance=False, spread=[True], fused=True)
    assert (off.total - 3, off.crossing - 1) == (10, 5)  # without the fast loop: no change
