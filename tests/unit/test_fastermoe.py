"""fastermoe's shadowing search: the floor that ends it early never changes a plan."""

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.planner import ModelSpec, Topology, make_policy
from expertmesh.planner.costmodel import CostSettings, modeled_step, step_cost
from expertmesh.planner.fastermoe import FasterMoEPolicy, shadow, shadow_floor, shadow_traffic
from expertmesh.planner.policy import PolicyContext
from expertmesh.planner.topology import Link
from expertmesh.planner.traffic import even_traffic


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


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_shadow_floor_never_exceeds_the_modeled_step(seed):
    topo, model, cost, load = _case(seed)
    pol = make_policy("fastermoe", {"cost": cost.model_dump()})
    assert isinstance(pol, FasterMoEPolicy)
    ctx = PolicyContext(topo, model, 0, 0, load, np.zeros((0, *load.shape), np.int64))
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
    topo, model, cost, load = _case(seed)
    pol = make_policy("fastermoe", {"cost": cost.model_dump()})
    assert isinstance(pol, FasterMoEPolicy)
    ctx = PolicyContext(topo, model, 0, 0, load, np.zeros((0, *load.shape), np.int64))
    got, want = pol.place(ctx), _plain_place(pol, ctx)
    assert np.array_equal(got.phy2log, want.phy2log)
    assert np.array_equal(got.master, want.master)


def test_the_cases_shadow_sometimes_and_the_floor_ends_searches():
    """The two tests above see both outcomes: plans with shadows, and first candidates the
    floor rules out (else they would prove little)."""
    shadows = floored = 0
    for seed in range(60):
        topo, model, cost, load = _case(seed)
        pol = make_policy("fastermoe", {"cost": cost.model_dump()})
        ctx = PolicyContext(topo, model, 0, 0, load, np.zeros((0, *load.shape), np.int64))
        base = pol.masters(ctx)
        shadows += int(pol.place(ctx).holds().sum() > model.num_experts)
        traffic = even_traffic(load, base, topo, model.top_k, domain="rank")
        hot = int(np.argmax(load.sum(axis=0)))
        best = step_cost(topo, model, traffic, None, cost).seconds
        floor = shadow_floor(traffic, load, base, hot, topology=topo, model=model, settings=cost)
        floored += floor > best
    assert shadows >= 5 and floored >= 5
