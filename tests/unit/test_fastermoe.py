"""fastermoe's shadowing search: the floor that ends it early never changes a plan, and
the master placement's traffic it starts from is the even split's, to the bit."""

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.planner import ModelSpec, Topology, make_policy
from expertmesh.planner.costmodel import CostSettings, modeled_step, step_cost
from expertmesh.planner.fastermoe import (
    FasterMoEPolicy,
    master_traffic,
    shadow,
    shadow_floor,
    shadow_traffic,
)
from expertmesh.planner.plan import Placement
from expertmesh.planner.policy import PolicyContext
from expertmesh.planner.static import static_placement
from expertmesh.planner.topology import Link
from expertmesh.planner.traffic import TokenTraffic, even_traffic


def _case(seed: int) -> tuple[Topology, ModelSpec, CostSettings, np.ndarray]:
    """A random topology (per-pair links), model, cost settings and skewed load."""
    rng = np.random.default_rng(seed)
    dcs, nodes = int(rng.integers(2, 5)), int(rng.integers(1, 3))
    topo = Topology.generate(
        dcs, 2 * nodes, nodes_per_dc=nodes, masters=2, spare=int(rng.integers(1, 4)),
        inter_dc_gbps=float(10.0 ** rng.uniform(-2, 2.5)),
        inter_dc_latency_ms=float(rng.uniform(0, 40)),
    )  # fmt: skip
    names = [d.name for d in topo.dcs]
    pairs = {
        (names[a], names[b]): Link(float(10.0 ** rng.uniform(-2, 2.5)), float(rng.uniform(0, 40)))
        for a in range(dcs)
        for b in range(a + 1, dcs)
        if rng.random() < 0.5
    }
    topo = dataclasses.replace(topo, pairs=pairs)
    num_experts = 2 * topo.num_ranks
    model = ModelSpec(
        num_experts=num_experts, top_k=int(rng.integers(1, 4)), hidden=int(rng.choice([64, 1024])),
        ffn_hidden=int(rng.choice([1, 256, 4096])), training=bool(rng.random() < 0.8),
    )  # fmt: skip
    cost = CostSettings(
        flops_per_second=float(10.0 ** rng.uniform(11, 15)),
        pipeline_chunks=int(rng.choice([1, 1, 1, 2])),
        microbatches_per_update=int(rng.choice([1, 1, 4])),
        hierarchical=bool(rng.random() < 0.7),
        message_seconds=float(rng.choice([0.0, 1e-3])),
    )
    p = rng.dirichlet(np.full(num_experts, float(rng.choice([0.1, 1.0]))))
    load = rng.multinomial(int(rng.integers(1, 5000)) * model.top_k, p, size=topo.num_ranks)
    return topo, model, cost, load


def _policy_case(seed: int):
    """``_case(seed)``, the fastermoe policy with its cost settings and the step's context."""
    topo, model, cost, load = _case(seed)
    pol = make_policy("fastermoe", {"cost": cost.model_dump()})
    assert isinstance(pol, FasterMoEPolicy)
    ctx = PolicyContext(topo, model, 0, 0, load, np.zeros((0, *load.shape), np.int64))
    return topo, model, cost, load, pol, ctx


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_shadow_floor_never_exceeds_the_modeled_step(seed):
    topo, model, cost, load, pol, ctx = _policy_case(seed)
    base = pol.masters(ctx)
    order = np.argsort(-load.sum(axis=0), kind="stable")
    traffic = even_traffic(load, base, topo, model.top_k, domain="rank")
    for j in range(1, topo.spare_per_rank + 1):
        e = int(order[j - 1])
        floor = shadow_floor(traffic, load, base, e, topology=topo, model=model, settings=cost)
        traffic = shadow_traffic(traffic, load, base, topo, e)
        c = modeled_step(topo, model, traffic, shadow(base, order[:j]), settings=cost).seconds
        assert floor <= c * (1 + 1e-12)


def _plain_place(pol: FasterMoEPolicy, ctx: PolicyContext):
    """The shadowing search without the floor: every candidate costed."""
    base = pol.masters(ctx)
    topo, model, cs = ctx.topology, ctx.model, pol.cfg.cost
    order = np.argsort(-ctx.load.sum(axis=0), kind="stable")
    traffic = even_traffic(ctx.load, base, topo, model.top_k, domain="rank")
    best, best_cost = base, step_cost(topo, model, traffic, None, cs).seconds
    for j in range(1, topo.spare_per_rank + 1):
        cand = shadow(base, order[:j])
        traffic = shadow_traffic(traffic, ctx.load, base, topo, int(order[j - 1]))
        c = modeled_step(topo, model, traffic, cand, settings=cs).seconds
        if c >= best_cost:
            break
        best, best_cost = cand, c
    return best


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_the_floor_changes_no_plan(seed):
    *_, pol, ctx = _policy_case(seed)
    got, want = pol.place(ctx), _plain_place(pol, ctx)
    assert np.array_equal(got.phy2log, want.phy2log)
    assert np.array_equal(got.master, want.master)


def test_the_cases_shadow_sometimes_and_the_floor_ends_searches():
    """The two tests above see both outcomes: plans with shadows, and first candidates the
    floor rules out (else they would prove little)."""
    shadows = floored = 0
    for seed in range(60):
        topo, model, cost, load, pol, ctx = _policy_case(seed)
        base = pol.masters(ctx)
        shadows += int(pol.place(ctx).holds().sum() > model.num_experts)
        traffic = even_traffic(load, base, topo, model.top_k, domain="rank")
        hot = int(np.argmax(load.sum(axis=0)))
        best = step_cost(topo, model, traffic, None, cost).seconds
        floor = shadow_floor(traffic, load, base, hot, topology=topo, model=model, settings=cost)
        floored += floor > best
    assert shadows >= 5 and floored >= 5


def _masters_only(topo: Topology, num_experts: int, rng: np.random.Generator) -> Placement:
    """Masters in random slots (one copy per expert), as a run's alignment may leave them."""
    slots = rng.permutation(topo.num_ranks * topo.slots_per_rank)[:num_experts]
    phy2log = np.full(topo.num_ranks * topo.slots_per_rank, -1, np.int32)
    phy2log[slots] = np.arange(num_experts)
    return Placement(phy2log.reshape(topo.num_ranks, -1), slots.astype(np.int64))


def _assert_same_traffic(got: TokenTraffic, want: TokenTraffic) -> None:
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, f.name
        assert np.array_equal(a, b), f.name  # the same floats, not close ones


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), static=st.booleans())
def test_master_traffic_is_the_even_split_to_the_bit(seed, static):
    topo, model, _, load = _case(seed)
    rng = np.random.default_rng(seed)
    if static:
        masters = static_placement(topo.num_ranks, topo.slots_per_rank, model.num_experts, 2)
    else:
        masters = _masters_only(topo, model.num_experts, rng)
    load[:, rng.integers(0, model.num_experts, 3)] = 0  # experts without tokens
    got = master_traffic(load, masters, topo, model.top_k)
    for domain in ("rank", "global"):  # one copy each: every domain splits alike
        _assert_same_traffic(got, even_traffic(load, masters, topo, model.top_k, domain=domain))


def test_route_traffic_is_the_costed_plans_traffic_and_only_its():
    shadowed = 0
    for seed in range(40):
        topo, model, _, load, pol, ctx = _policy_case(seed)
        plan = pol.place(ctx)
        shadowed += int(plan.holds().sum() > model.num_experts)
        moved = Placement(plan.phy2log[:, ::-1].copy(), plan.master)  # slots permuted
        moved = dataclasses.replace(moved, master=_slot_of(moved, plan))
        got = pol.route_traffic(ctx, moved)
        assert got is not None
        _assert_same_traffic(got, even_traffic(load, moved, topo, model.top_k, domain="rank"))
        other = PolicyContext(topo, model, 1, 0, load, np.zeros((0, *load.shape), np.int64))
        assert pol.route_traffic(other, plan) is None  # another context
        if plan.holds().sum() > model.num_experts:  # shadows: the bare masters differ
            assert pol.route_traffic(ctx, pol.masters(ctx)) is None
    assert shadowed >= 5  # some plans have shadows: the last check above ran


def _slot_of(moved: Placement, plan: Placement) -> np.ndarray:
    """``plan``'s masters in ``moved``, whose slots are ``plan``'s reversed per rank."""
    num_slots = plan.slots_per_rank
    rank, slot = plan.master // num_slots, plan.master % num_slots
    return rank * num_slots + (num_slots - 1 - slot)


def test_master_traffic_counts_a_dc_without_ranks():
    """A DC with no nodes (the constructor takes one) still has its entry: ``dc_tokens``
    and the DC pairs indexed by DC, not by run of ranks, as the even split gives them."""
    from expertmesh.planner.topology import DC

    topo = Topology((DC("a", 1, 2), DC("z", 0, 2), DC("c", 1, 2)), 2, 1)
    masters = static_placement(topo.num_ranks, topo.slots_per_rank, 4, 1)
    load = np.random.default_rng(3).integers(0, 20, size=(topo.num_ranks, 4))
    got = master_traffic(load, masters, topo, 2)
    assert got.dc_tokens.shape == (3,) and got.dc_tokens[1] == 0
    _assert_same_traffic(got, even_traffic(load, masters, topo, 2, domain="rank"))
