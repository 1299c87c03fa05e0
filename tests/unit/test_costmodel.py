"""The cost model against hand-computed cases, and the fast traffic path against its reference."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.planner import ModelSpec, Placement, Topology
from expertmesh.planner.costmodel import (
    CostSettings,
    ExpertStreams,
    TransferEncoding,
    crossings,
    migration_streams,
    replica_streams,
    step_cost,
    step_costs,
)
from expertmesh.planner.refs import even_route_ref
from expertmesh.planner.routing import route_even
from expertmesh.planner.topology import DC, Link
from expertmesh.planner.traffic import (
    TokenTraffic,
    even_traffic,
    even_traffic_steps,
    traffic_from_route,
)

# Two DCs of one rank each. WAN: 8 Gbit/s = 1e9 B/s, 10 ms. NIC: 1e11 B/s, no latency.
TOPO = Topology(
    dcs=(DC("a", 1, 1), DC("b", 1, 1)),
    masters_per_rank=1,
    spare_per_rank=1,
    intra_node=Link(8000, 0.0),
    intra_dc=Link(800, 0.0),
    inter_dc=Link(8, 10.0),
)
# hidden 1000 x 2 bytes: a token is 2,000 bytes; P = 3 * 1000 * 10 = 30,000 params.
FWD = ModelSpec(num_experts=2, top_k=1, hidden=1000, ffn_hidden=10, training=False)
TRAIN = FWD.model_copy(update={"training": True})
CS = CostSettings(flops_per_second=1e9)
STATIC = Placement(np.array([[0, -1], [1, -1]], np.int32), np.array([0, 2]))
LOAD = np.array([[0, 1000], [0, 0]])  # rank 0 sends 1,000 tokens to expert 1 (on rank 1)


def _traffic(placement, domain="dc", model=FWD, load=LOAD):
    return even_traffic(load, placement, TOPO, model.top_k, domain=domain)


def test_forward_only_by_hand():
    c = step_cost(TOPO, FWD, _traffic(STATIC), settings=CS)
    # dispatch: 10 ms + 1000 * 2000 B / 1e9 B/s = 12 ms; compute 1000 * 2 * 30000 / 1e9 = 60 ms
    assert c.phases["dispatch"] == pytest.approx(0.012)
    assert c.phases["compute_fwd"] == pytest.approx(0.060)
    assert c.phases["combine"] == pytest.approx(0.012)
    assert c.seconds == pytest.approx(0.084)
    assert c.cross_dc_token_bytes == pytest.approx(2 * 1000 * 2000)
    assert c.bottleneck == "chain: compute_fwd"


def test_training_adds_the_backward_chain():
    c = step_cost(TOPO, TRAIN, _traffic(STATIC, model=TRAIN), settings=CS)
    assert c.phases["compute_bwd"] == pytest.approx(0.120)
    assert c.seconds == pytest.approx(0.084 + 0.012 + 0.120 + 0.012)
    assert c.cross_dc_token_bytes == pytest.approx(4 * 1000 * 2000)


def test_pipelining_overlaps_communication_with_compute():
    cs = CS.model_copy(update={"pipeline_chunks": 2})
    c = step_cost(TOPO, FWD, _traffic(STATIC), settings=cs)
    assert c.seconds == pytest.approx(0.060 + (0.012 + 0.012) / 2)


def test_replica_keeps_tokens_home_but_returns_its_gradient():
    rep = Placement(np.array([[0, 1], [1, -1]], np.int32), np.array([0, 2]))
    streams = replica_streams(rep, TOPO, TRAIN, CS)
    # weights out (b -> a) in the background, gradient back (a -> b) on the tail: 60,000 B each
    assert streams.pair_src.tolist() == [1, 0]
    assert streams.pair_background.tolist() == [60_000, 0]
    assert streams.pair_tail.tolist() == [0, 60_000]
    c = step_cost(TOPO, TRAIN, _traffic(rep, model=TRAIN), streams, CS)
    assert c.cross_dc_token_bytes == 0
    assert c.cross_dc_weight_bytes == pytest.approx(120_000)
    # forward: compute only; backward: compute, then the gradient over the WAN
    assert c.seconds == pytest.approx(0.060 + 0.120 + 0.010 + 60_000 / 1e9)


def test_gradient_accumulation_moves_replica_sync_to_the_background():
    rep = Placement(np.array([[0, 1], [1, -1]], np.int32), np.array([0, 2]))
    cs = CS.model_copy(update={"microbatches_per_update": 4})
    streams = replica_streams(rep, TOPO, TRAIN, cs)
    assert streams.pair_tail.sum() == 0
    assert streams.pair_background.tolist() == [15_000, 15_000]
    c = step_cost(TOPO, TRAIN, _traffic(rep, model=TRAIN), streams, cs)
    assert c.seconds == pytest.approx(0.180)


def test_forward_only_replicas_have_no_sync():
    rep = Placement(np.array([[0, 1], [1, -1]], np.int32), np.array([0, 2]))
    assert replica_streams(rep, TOPO, FWD, CS).cross_dc_bytes == 0


def test_background_bytes_bound_the_step_when_a_link_is_full():
    mig = migration_streams(np.array([0]), np.array([1]), np.array([1e10]), TOPO, scale=0.5)
    c = step_cost(TOPO, FWD, _traffic(STATIC), mig, CS)
    # link a -> b: half the migration plus the dispatch of 1,000 tokens (combine runs b -> a)
    assert c.resource_seconds == pytest.approx(5e9 / 1e9 + 1000 * 2000 / 1e9)
    assert c.seconds == c.resource_seconds
    assert c.bottleneck == "link a->b"


def test_per_pair_link_overrides_apply():
    slow = Topology(TOPO.dcs, 1, 1, TOPO.intra_node, TOPO.intra_dc, TOPO.inter_dc,
                    {("a", "b"): Link(0.8, 50.0)})  # fmt: skip
    c = step_cost(slow, FWD, even_traffic(LOAD, STATIC, slow, 1, domain="dc"), settings=CS)
    assert c.phases["dispatch"] == pytest.approx(0.050 + 2e6 / 1e8)


def test_ports_bound_dispatch_inside_a_dc():
    one = Topology((DC("a", 2, 1),), 1, 1, Link(8000, 0.0), Link(0.008, 1.0), Link(8, 10.0))
    load = np.array([[0, 1000], [0, 0]])
    c = step_cost(one, FWD, even_traffic(load, STATIC, one, 1), settings=CS)
    # rank 0 -> rank 1 on another node: NIC at 1e6 B/s, 1 ms latency
    assert c.phases["dispatch"] == pytest.approx(0.001 + 2e6 / 1e6)
    assert c.cross_dc_token_bytes == 0


def _traffic_k(n, a, k):
    return TokenTraffic(
        np.zeros(2), np.zeros((2, 3)), np.zeros((2, 3)), np.array([0]), np.array([1]),
        np.array([a], float), np.array([n, 0.0]),
    )  # fmt: skip


def test_hierarchical_crossings_by_hand():
    # 100 tokens, top-2, half of the 200 assignments land in DC 1: 100 * (1 - 0.5^2) = 75
    assert crossings(_traffic_k(100, 100, 2), 2)[0] == pytest.approx(75.0)
    # all assignments there: every token crosses once
    assert crossings(_traffic_k(100, 200, 2), 2)[0] == pytest.approx(100.0)
    assert crossings(_traffic_k(100, 100, 2), 2, hierarchical=False)[0] == 100.0


@given(n=st.floats(1, 1e6), frac=st.floats(0, 1), k=st.integers(1, 16))
def test_crossings_stay_between_their_bounds(n, frac, k):
    a = frac * n * k
    x = crossings(_traffic_k(n, a, k), k)[0]
    assert a / k - 1e-6 <= x <= min(a, n) + 1e-6


def test_encoding_shrinks_refresh_and_copies():
    m = ModelSpec(hidden=8, ffn_hidden=8)  # P = 192
    assert TransferEncoding().refresh_bytes(m) == 192 * 2
    assert TransferEncoding(weight_bytes=1).refresh_bytes(m) == 192
    assert TransferEncoding(changed_fraction=0.25).refresh_bytes(m) == 192 * (0.5 + 0.125)
    assert TransferEncoding().copy_bytes(m, master=True) == 192 * (2 + 12)


def test_expert_streams_add():
    a = migration_streams(np.array([0]), np.array([1]), np.array([5.0]), TOPO)
    b = a + ExpertStreams.empty(2)
    assert b.cross_dc_bytes == 5.0 and b.port_background[0, 2] == 5.0


def test_traffic_mismatch_is_a_value_error():
    t = _traffic(STATIC)
    three = Topology.generate(3, 1, masters=1, spare=1)
    with pytest.raises(ValueError, match="ranks"):
        step_cost(three, FWD, t)


# ---- even_traffic against the reference and against route_even ----


def _random_case(seed):
    rng = np.random.default_rng(seed)
    topo = Topology((DC("a", 2, 2), DC("b", 1, 3), DC("c", 2, 1)), 2, 2)
    num_ranks, num_experts, slots = topo.num_ranks, 6, 4
    phy = np.full((num_ranks, slots), -1, np.int32)
    master = np.empty(num_experts, np.int64)
    for e in range(num_experts):
        phy[e % num_ranks, e // num_ranks] = e
        master[e] = (e % num_ranks) * slots + e // num_ranks
    for r in range(num_ranks):
        for s in range(2, slots):
            if rng.random() < 0.5:
                phy[r, s] = rng.integers(num_experts)
    load = rng.integers(0, 50, size=(num_ranks, num_experts)) * rng.integers(0, 2, (1, num_experts))
    return topo, Placement(phy, master), load


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    domain=st.sampled_from(["rank", "node", "dc", "global"]),
    remote=st.sampled_from(["spread", "master"]),
)
def test_even_traffic_equals_reference(seed, domain, remote):
    topo, pl, load = _random_case(seed)
    fast = even_traffic(load, pl, topo, 2, domain=domain, remote=remote)
    ref = traffic_from_route(even_route_ref(load, pl, topo, domain, remote), load, topo, 2)
    np.testing.assert_allclose(fast.rank_tokens, ref.rank_tokens, atol=1e-9)
    np.testing.assert_allclose(fast.rank_out, ref.rank_out, atol=1e-9)
    np.testing.assert_allclose(fast.rank_in, ref.rank_in, atol=1e-9)
    got = {
        (a, b): v for a, b, v in zip(fast.pair_src, fast.pair_dst, fast.pair_tokens, strict=True)
    }
    want = {(a, b): v for a, b, v in zip(ref.pair_src, ref.pair_dst, ref.pair_tokens, strict=True)}
    assert got.keys() == want.keys()
    for key, v in want.items():
        assert got[key] == pytest.approx(v)
    np.testing.assert_allclose(fast.dc_tokens, ref.dc_tokens)


@pytest.mark.parametrize("domain", ["rank", "node", "dc", "global"])
def test_even_traffic_matches_route_even_up_to_rounding(domain):
    topo, pl, load = _random_case(3)
    dom = {"rank": np.arange(topo.num_ranks), "node": topo.rank_node, "dc": topo.rank_dc,
           "global": None}[domain]  # fmt: skip
    exact = traffic_from_route(route_even(load, pl, dom), load, topo, 2)
    fast = even_traffic(load, pl, topo, 2, domain=domain)
    # route_even rounds each (rank, expert) split to whole tokens: off by < 1 per pair
    bound = int(np.count_nonzero(load))
    assert np.abs(exact.rank_tokens - fast.rank_tokens).max() < bound
    assert exact.rank_tokens.sum() == pytest.approx(fast.rank_tokens.sum())
    assert exact.pair_tokens.sum() == pytest.approx(fast.pair_tokens.sum(), abs=bound)


def test_even_traffic_is_the_same_with_placements_seen_before():
    # even_traffic keeps what it derives from a placement per topology (the simulator asks
    # for the same placement step after step): many placements on one topology, each asked
    # twice and interleaved, give what a fresh topology (nothing kept) gives, to the bit
    cases = [_random_case(seed) for seed in range(12)]
    shared = cases[0][0]
    for topo, pl, load in cases + cases[::-1]:
        for domain in ("dc", "global"):
            got = even_traffic(load, pl, shared, 2, domain=domain)
            fresh = Topology(topo.dcs, topo.masters_per_rank, topo.spare_per_rank)
            want = even_traffic(load, pl, fresh, 2, domain=domain)
            for f in ("rank_tokens", "rank_out", "rank_in", "pair_src", "pair_tokens"):
                assert np.array_equal(getattr(got, f), getattr(want, f)), f


@pytest.mark.parametrize("seed", [0, 5, 11])
def test_even_traffic_steps_is_even_traffic_of_each_step_to_the_bit(seed):
    # the simulator costs a placement's steps together: every split, uneven nodes and DCs
    topo, pl, _ = _random_case(seed)
    loads = np.stack([_random_case(seed * 7 + t)[2] for t in range(5)])  # [T, R, E]
    loads[:, :, 0] += 1  # at least one expert with load on every rank
    _assert_steps_are_even_traffic(loads, pl, topo)


@pytest.mark.parametrize("dcs, ranks, nodes", [(3, 4, 2), (9, 2, 1)])
def test_even_traffic_steps_on_equal_nodes_is_even_traffic_to_the_bit(dcs, ranks, nodes):
    # equal nodes and DCs: the level sums of every step from a [T, G, p, E] view
    topo = Topology.generate(dcs, ranks, nodes_per_dc=nodes, masters=2, spare=2)
    rng = np.random.default_rng(dcs)
    num_experts, slots = 2 * topo.num_ranks, topo.slots_per_rank
    phy = np.full((topo.num_ranks, slots), -1, np.int32)
    phy[:, :2] = np.arange(num_experts).reshape(topo.num_ranks, 2)
    phy[:, 2:] = rng.integers(0, num_experts, (topo.num_ranks, slots - 2))
    master = np.arange(num_experts) // 2 * slots + np.arange(num_experts) % 2
    pl = Placement(phy, master)
    loads = rng.integers(0, 50, size=(6, topo.num_ranks, num_experts))
    _assert_steps_are_even_traffic(loads, pl, topo)


@pytest.mark.parametrize("seed", [0, 3])
def test_even_traffic_steps_of_one_copy_placements_is_even_traffic_to_the_bit(seed):
    # at most one copy per expert (static EP): summed in int64 (_one_copy_split)
    topo, _, _ = _random_case(seed)
    rng = np.random.default_rng(seed)
    slots, num_experts = 4, 9
    flat = rng.permutation(topo.num_ranks * slots)[:num_experts]  # some ranks hold none
    phy = np.full(topo.num_ranks * slots, -1, np.int32)
    phy[flat] = np.arange(num_experts)
    pl = Placement(phy.reshape(topo.num_ranks, slots), flat.astype(np.int64))
    loads = rng.integers(0, 60, size=(4, topo.num_ranks, num_experts))
    loads[:, :, -1] = 0  # an expert without load
    _assert_steps_are_even_traffic(loads, pl, topo)


def test_even_traffic_refuses_experts_without_copies():
    pl = Placement(np.array([[0, -1], [0, -1]], np.int32), np.array([0, 1]))
    with pytest.raises(ValueError, match="no copy"):
        even_traffic(LOAD, pl, TOPO, 1)


def test_message_seconds_are_paid_by_every_communication_phase():
    o = 0.003
    cs = CS.model_copy(update={"message_seconds": o})
    c = step_cost(TOPO, TRAIN, _traffic(STATIC, model=TRAIN), settings=cs)
    assert c.seconds == pytest.approx(0.084 + 0.012 + 0.120 + 0.012 + 4 * o)
    assert c.phases["dispatch"] == pytest.approx(0.012 + o)
    chunked = cs.model_copy(update={"pipeline_chunks": 2})
    c = step_cost(TOPO, FWD, _traffic(STATIC), settings=chunked)
    assert c.seconds == pytest.approx(0.060 + (0.012 + 2 * o + 0.012 + 2 * o) / 2)


def test_top2_nic_bottleneck_counts_a_token_once_per_remote_dc():
    """Hand-worked top-2 case where the sender's NIC sets the step. DC a: rank 0; DC b: ranks
    1-4 on four nodes, expert e on rank e. NIC 0.08 Gbit/s = 1e7 B/s, no latency; WAN 1e9 B/s,
    10 ms. Rank 0 has 1,000 tokens and sends both top-2 choices of each to DC b: 2,000
    assignments, 500 per expert 1-4. A token leaves rank 0's NIC once for DC b (rho = X / A =
    1,000 / 2,000), so NIC out = 1,000 tokens * 2,000 B = 2e6 B: 0.2 s; each receiver's NIC
    takes 500 * 2,000 B = 1e6 B: 0.1 s; the WAN 10 ms + 2e6 / 1e9 = 12 ms. Dispatch = 0.2 s,
    combine the same reversed, compute 500 * 2 * 30,000 / 1e9 = 0.03 s."""
    topo = Topology(
        dcs=(DC("a", 1, 1), DC("b", 4, 1)),
        masters_per_rank=1,
        spare_per_rank=0,
        intra_node=Link(8000, 0.0),
        intra_dc=Link(0.08, 0.0),
        inter_dc=Link(8, 10.0),
    )
    model = ModelSpec(num_experts=5, top_k=2, hidden=1000, ffn_hidden=10, training=False)
    placement = Placement(np.arange(5, dtype=np.int32)[:, None], np.arange(5))
    load = np.zeros((5, 5), np.int64)
    load[0, 1:] = 500
    traffic = even_traffic(load, placement, topo, model.top_k, domain="dc")
    assert crossings(traffic, 2).tolist() == [1000.0]  # every token crosses exactly once
    c = step_cost(topo, model, traffic, settings=CS)
    assert c.phases["dispatch"] == pytest.approx(0.2)
    assert c.phases["combine"] == pytest.approx(0.2)
    assert c.phases["compute_fwd"] == pytest.approx(0.03)
    assert c.seconds == pytest.approx(0.43)
    assert c.bottleneck == "chain: dispatch"
    assert c.cross_dc_token_bytes == pytest.approx(2 * 1000 * 2000)
    # one crossing per assignment: the NIC carries both copies of every token
    flat = step_cost(topo, model, traffic, settings=CS.model_copy(update={"hierarchical": False}))
    assert flat.phases["dispatch"] == pytest.approx(0.4)


def test_migration_streams_use_the_fabric_each_pair_of_ranks_shares():
    """One DC of two nodes x two ranks (0, 1 | 2, 3) and a second DC (ranks 4, 5). Moves:
    0 -> 1 (same node: node fabric), 0 -> 2 (other node: NIC), 3 -> 4 (other DC: NIC and the
    WAN), 100, 200 and 400 bytes, half of each streamed this step. Columns: node out, node in,
    NIC out, NIC in; a rank's bytes add up over its moves."""
    topo = Topology((DC("a", 2, 2), DC("b", 1, 2)), 1, 1, Link(8000, 0.0), Link(800, 0.0),
                    Link(8, 10.0))  # fmt: skip
    s = migration_streams([0, 0, 3], [1, 2, 4], [100, 200, 400], topo, scale=0.5)
    want = np.zeros((6, 4))
    want[0] = [50, 0, 100, 0]  # out to 1 over the node fabric, out to 2 over the NIC
    want[1] = [0, 50, 0, 0]
    want[2] = [0, 0, 0, 100]
    want[3] = [0, 0, 200, 0]
    want[4] = [0, 0, 0, 200]
    assert s.port_background.tolist() == want.tolist() and not s.port_tail.any()
    assert (s.pair_src.tolist(), s.pair_dst.tolist(), s.pair_background.tolist()) == (
        [0],
        [1],
        [200],
    )
    none = migration_streams([], [], [], topo)
    assert none.port_background.shape == (6, 4) and none.cross_dc_bytes == 0


def test_expert_streams_add_every_column():
    a = migration_streams(np.array([0]), np.array([1]), np.array([5.0]), TOPO)
    rep = Placement(np.array([[0, 1], [1, -1]], np.int32), np.array([0, 2]))
    b = replica_streams(rep, TOPO, TRAIN, CS)
    c = a + b
    assert np.array_equal(c.port_tail, a.port_tail + b.port_tail) and c.port_tail.any()
    assert np.array_equal(c.port_background, a.port_background + b.port_background)
    assert c.cross_dc_bytes == pytest.approx(a.cross_dc_bytes + b.cross_dc_bytes)


def test_copy_bytes_by_hand():
    """P = 192 params, 2-byte weights, 12 bytes of optimizer state per param (the model's)."""
    m = ModelSpec(hidden=8, ffn_hidden=8)
    enc = TransferEncoding()
    assert enc.copy_bytes(m, master=False) == 192 * 2
    assert enc.copy_bytes(m, master=True) == 192 * (2 + 12)
    # the receiver held an older copy: the changed quarter plus a 1-bit mask per weight
    assert enc.copy_bytes(m, master=False, changed=0.25) == 192 * (0.25 * 2 + 1 / 8)
    one = TransferEncoding(weight_bytes=1)
    assert one.copy_bytes(m, master=False) == 192
    assert one.copy_bytes(m, master=True, changed=0.5) == 192 * (0.5 + 1 / 8 + 12)


@pytest.mark.parametrize("nodes", [1, 2])
def test_level_sums_are_node_then_dc_sums(nodes):
    # DC sums are the sums of the DC's node sums; with one node per DC they are copied, the
    # same floats as adding the one-row runs onto zeros
    from expertmesh.planner.traffic import level_sums

    topo = Topology((DC("a", nodes, 3), DC("b", nodes, 2), DC("c", nodes, 1)), 2, 2)
    x = np.random.default_rng(nodes).random((topo.num_ranks, 5)) * 1e3
    node, dc = np.zeros((topo.num_nodes, 5)), np.zeros((topo.num_dcs, 5))
    np.add.at(node, topo.rank_node, x)
    got = level_sums(x, topo)
    np.testing.assert_allclose(got[1], node, rtol=1e-12)
    node_dc = np.array(
        [topo.rank_dc[np.flatnonzero(topo.rank_node == n)[0]] for n in range(topo.num_nodes)]
    )
    starts = np.flatnonzero(np.r_[True, node_dc[1:] != node_dc[:-1]])
    dc[node_dc[starts]] += np.add.reduceat(got[1], starts, axis=0)
    assert np.array_equal(got[2], dc)
    assert np.array_equal(got[3], dc.sum(axis=0, keepdims=True))


@settings(max_examples=150, deadline=None)
@given(
    dcs=st.integers(1, 4),
    nodes=st.integers(1, 3),
    per_node=st.integers(1, 12),
    cols=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([1.0, 1e-3, 7.0, 1e6]),
)
def test_level_sums_equal_reduceat_bit_for_bit(dcs, nodes, per_node, cols, seed, scale):
    # level_sums sums runs of equal nodes (up to 8 ranks) without np.add.reduceat: the same
    # floats as reduceat (the simulator's rows are pinned to the bit), equal or unequal nodes
    from expertmesh.planner.traffic import level_sums

    rng = np.random.default_rng(seed)
    sizes = [per_node] * dcs if rng.random() < 0.7 else rng.integers(1, 12, dcs).tolist()
    topo = Topology(tuple(DC(f"d{i}", nodes, nodes * n) for i, n in enumerate(sizes)), 2, 2)
    x = rng.random((topo.num_ranks, cols)) ** 3 * scale
    x[rng.random(x.shape) < 0.2] = 0.0
    node_dc = np.array(
        [topo.rank_dc[np.flatnonzero(topo.rank_node == n)[0]] for n in range(topo.num_nodes)]
    )
    want = [x, np.zeros((topo.num_nodes, cols)), np.zeros((topo.num_dcs, cols))]
    for k, index in enumerate((topo.rank_node, node_dc)):
        starts = np.flatnonzero(np.r_[True, index[1:] != index[:-1]])
        want[k + 1][index[starts]] += np.add.reduceat(want[k], starts, axis=0)
    got = level_sums(x, topo)
    for g, w in zip(got[1:3], want[1:], strict=True):
        assert g.tobytes() == w.tobytes()


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 4)), min_size=1, max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_shell_equals_link_class(sizes, seed):
    # the cost model's link classes are the topology's
    from expertmesh.planner.costmodel import _shell

    topo = Topology(tuple(DC(f"d{i}", n, n * p) for i, (n, p) in enumerate(sizes)), 2, 2)
    rng = np.random.default_rng(seed)
    a = rng.integers(0, topo.num_ranks, 60)
    b = np.where(rng.random(60) < 0.2, a, rng.integers(0, topo.num_ranks, 60))
    shell = _shell(topo, a, b)
    assert shell.tolist() == np.asarray(topo.link_class(a, b)).tolist()


@settings(max_examples=60, deadline=None)
@given(ranks=st.integers(1, 20), copies=st.integers(0, 80), seed=st.integers(0, 2**32 - 1))
def test_shell_sums_equal_one_bincount_per_shell(ranks, copies, seed):
    # what ranks receive by shell (even_traffic, weighted_traffic): one bincount over
    # (rank, shell) bins gives the floats of one bincount per shell
    from expertmesh.planner.traffic import _shell_sums

    rng = np.random.default_rng(seed)
    rank = rng.integers(0, ranks, copies)
    in_shell = rng.random((copies, 4)) ** 3 * 1e4
    want = np.stack(
        [np.bincount(rank, weights=in_shell[:, j], minlength=ranks) for j in (1, 2, 3)], axis=1
    )
    assert _shell_sums(rank, in_shell, ranks).tobytes() == want.tobytes()


# ---- step_costs: step_cost of many items at once ----


def _cost_item(rng, topo, model, settings, case):
    """A traffic and expert streams on ``topo``: an even split of a random placement and
    load (no load at all when ``case == 0``; exact crossings when 5), its replica sync and
    random transfers."""
    _, pl, load = _random_case(int(rng.integers(10_000)))
    if case == 0:
        load = np.zeros_like(load)
    domain = ["rank", "node", "dc", "global"][case % 4]
    traffic = even_traffic(load, pl, topo, model.top_k, domain=domain)
    if case == 5:  # crossings known exactly (a runtime's)
        traffic = dataclasses.replace(traffic, pair_crossings=np.floor(traffic.pair_tokens / 2))
    streams = replica_streams(pl, topo, model, settings)
    m = int(rng.integers(0, 6))
    src, dst = rng.integers(0, topo.num_ranks, (2, m))
    streams = streams + migration_streams(src, dst, rng.uniform(0, 1e9, m), topo, scale=0.5)
    return traffic, streams


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    items=st.integers(1, 6),
    training=st.booleans(),
    hierarchical=st.booleans(),
    per_update=st.sampled_from([1, 4]),
    chunks=st.sampled_from([1, 3]),
    gbps=st.sampled_from([0.01, 10.0, 1e4]),
)
def test_step_costs_equal_step_cost_item_by_item(
    seed, items, training, hierarchical, per_update, chunks, gbps
):
    rng = np.random.default_rng(seed)
    topo = _random_case(0)[0].with_inter_dc(gbps)
    model = ModelSpec(num_experts=6, top_k=2, hidden=1000, ffn_hidden=10, training=training)
    cs = CostSettings(
        flops_per_second=1e9, hierarchical=hierarchical, microbatches_per_update=per_update,
        pipeline_chunks=chunks, message_seconds=0.001 * (chunks - 1),
    )  # fmt: skip
    cases = [_cost_item(rng, topo, model, cs, int(rng.integers(8))) for _ in range(items)]
    batched = step_costs(topo, model, [t for t, _ in cases], [s for _, s in cases], cs)
    assert batched == [step_cost(topo, model, t, s, cs) for t, s in cases]  # bit for bit


def test_step_costs_refuses_mismatched_inputs():
    t = _traffic(STATIC)
    with pytest.raises(ValueError, match="one ExpertStreams"):
        step_costs(TOPO, FWD, [t, t], [ExpertStreams.empty(2)], CS)
    assert step_costs(TOPO, FWD, [], [], CS) == []


def _sync_case(seed, per_update):
    """A random placement's case for replica_streams: topology, placement, a training
    model, its cost settings and the (weight, gradient) bytes of one sync per step."""
    topo, pl, _ = _random_case(seed)
    model = ModelSpec(num_experts=6, top_k=2, hidden=1000, ffn_hidden=10, training=True)
    cs = CostSettings(microbatches_per_update=per_update)
    enc = TransferEncoding()
    sizes = (enc.refresh_bytes(model) / per_update, enc.gradient_bytes(model) / per_update)
    return topo, pl, model, cs, sizes


@pytest.mark.parametrize("per_update", [1, 4])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_replica_streams_ports_copy_by_copy(seed, per_update):
    # every replica off its master's rank takes the weights in and sends its gradient out on
    # its node fabric or NIC; each master sends once and takes once per expert and fabric
    topo, pl, model, cs, (w, g) = _sync_case(seed, per_update)
    got = replica_streams(pl, topo, model, cs)
    back, grads = np.zeros((topo.num_ranks, 4)), np.zeros((topo.num_ranks, 4))
    grad = grads if per_update == 1 else back
    mrank = pl.master_rank()
    used = set()
    for r, s in zip(*np.nonzero(pl.phy2log >= 0), strict=True):
        e = int(pl.phy2log[r, s])
        m = int(mrank[e])
        if r == m:
            continue
        nic = 2 * int(topo.rank_node[r] != topo.rank_node[m])
        back[r, 1 + nic] += w
        grad[r, 0 + nic] += g
        used.add((nic, e))
    for nic, e in sorted(used):
        back[mrank[e], 0 + nic] += w
        grad[mrank[e], 1 + nic] += g
    np.testing.assert_allclose(got.port_background, back, rtol=1e-12)
    np.testing.assert_allclose(got.port_tail, grads if per_update == 1 else 0.0, rtol=1e-12)


def _assert_steps_are_even_traffic(loads, pl, topo):
    """even_traffic_steps of [T, R, E] ``loads`` equals even_traffic of each step, to the
    bit, in every domain and remote mode."""
    for domain in ("rank", "node", "dc", "global"):
        for remote in ("spread", "master"):
            got = even_traffic_steps(loads, pl, topo, 2, domain=domain, remote=remote)
            assert len(got) == len(loads)
            for t, g in enumerate(got):
                want = even_traffic(loads[t], pl, topo, 2, domain=domain, remote=remote)
                for f in ("rank_tokens", "rank_out", "rank_in", "pair_src", "pair_dst",
                          "pair_tokens", "dc_tokens"):  # fmt: skip
                    a, b = getattr(g, f), getattr(want, f)
                    assert a.shape == b.shape and np.array_equal(a, b), (domain, remote, t, f)


@pytest.mark.parametrize("per_update", [1, 4])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_replica_streams_memo_is_by_value(seed, per_update):
    # the memo serves a placement whose slots are permuted within ranks (the simulator's
    # alignment) the streams computed for it; every field equals a fresh computation of
    # each, to the bit, and the shared arrays are read-only; other master ranks: a miss
    from expertmesh.planner import costmodel

    topo, pl, model, cs, sizes = _sync_case(seed, per_update)
    rng = np.random.default_rng(seed)
    slots = pl.slots_per_rank
    perm = np.stack([rng.permutation(slots) for _ in range(pl.num_ranks)])  # new slot -> old
    where = np.argsort(perm, axis=1)  # old slot -> new
    r, s = np.divmod(pl.master, slots)
    shuffled = Placement(np.take_along_axis(pl.phy2log, perm, 1), r * slots + where[r, s])
    fields = [f.name for f in dataclasses.fields(ExpertStreams)]
    got = replica_streams(pl, topo, model, cs)
    for p in (pl, shuffled):
        fresh = costmodel._replica_streams(p, p.master_rank(), topo, cs, sizes)
        again = replica_streams(p, topo, model, cs)
        assert again is got
        for f in fields:
            np.testing.assert_array_equal(getattr(again, f), getattr(fresh, f))
            assert not getattr(again, f).flags.writeable
    # move one expert's master onto a rank already holding a replica of it: the same copies
    # on every rank (phy2log unchanged), only that master's rank differs
    mrank = pl.master_rank()
    held = [(int(r2), int(s2)) for r2, s2 in zip(*np.nonzero(pl.phy2log >= 0), strict=True)
            if r2 != mrank[pl.phy2log[r2, s2]]]  # fmt: skip
    assert held  # every seed here has a replica off its master's rank
    r2, s2 = held[0]
    e = int(pl.phy2log[r2, s2])
    moved = pl.master.copy()
    moved[e] = r2 * slots + s2
    elsewhere = Placement(pl.phy2log, moved)
    assert elsewhere.master_rank()[e] != mrank[e]
    assert (elsewhere.master_rank() != mrank).sum() == 1
    fresh = costmodel._replica_streams(elsewhere, elsewhere.master_rank(), topo, cs, sizes)
    assert any(not np.array_equal(getattr(fresh, f), getattr(got, f)) for f in fields)
    mine = replica_streams(elsewhere, topo, model, cs)
    assert mine is not got  # recomputed, not the first placement's entry
    for f in fields:
        np.testing.assert_array_equal(getattr(mine, f), getattr(fresh, f))
