"""quota's search domain by domain in plain Python (``quota._search_domains``) gives what
the vector search over all domains gives (``quota._search``, then ``_replicas`` of its
fit): the same ``T`` per domain and the same replicas in the same order."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import expertmesh.planner.quota as quota
from expertmesh.planner.plan import Placement
from expertmesh.planner.quota import balance_demand
from expertmesh.planner.static import static_placement


def _problem(seed: int, domains: int, ranks: int, skew: float, zeros: float):
    rng = np.random.default_rng(seed)
    num_ranks = domains * ranks
    masters, spare = int(rng.integers(1, 5)), int(rng.integers(0, 3))
    num_experts = num_ranks * masters - int(rng.integers(0, num_ranks))
    base = static_placement(num_ranks, masters + spare, num_experts, masters)
    demand = rng.multinomial(num_ranks * 500, rng.dirichlet(np.full(num_experts, skew)))
    demand[rng.random(num_experts) < zeros] = 0
    demand[rng.random(num_experts) < 0.1] = 37  # ties
    dom = rng.permutation(np.repeat(np.arange(domains), ranks))  # ranks of a domain scattered
    return demand.astype(np.int64), base, dom


def _vector(demand: np.ndarray, base: Placement, dom: np.ndarray):
    slots = base.phy2log.shape[1]
    pb = quota._problem(demand, base.master.astype(np.int64) // slots, slots, dom, None)
    t, fit = quota._search(pb, np.bincount(dom))
    return pb, t, quota._replicas(fit)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 100_000),
    domains=st.integers(1, 9),
    ranks=st.integers(1, 9),
    skew=st.sampled_from([0.05, 0.3, 2.0]),
    zeros=st.sampled_from([0.0, 0.3]),
)
def test_search_by_domain_equals_the_vector_search(seed, domains, ranks, skew, zeros):
    demand, base, dom = _problem(seed, domains, ranks, skew, zeros)
    pb, t, replicas = _vector(demand, base, dom)
    t2, replicas2 = quota._search_domains(pb)
    assert t2.tolist() == t.tolist()
    for a, b in zip(replicas, replicas2, strict=True):
        assert a.tolist() == b.tolist()
    sol = balance_demand(demand, base, dom)  # the solve takes the domain path
    assert sol.quota.tolist() == t.tolist()
    assert sol.replicas[1].tolist() == replicas[1].tolist()


def test_a_domain_above_its_bound_searches_like_the_vector_search():
    """Cases where some domain's ``T`` lies above its lower bound (probes after the first),
    several of them: the secant steps, ``T - 1`` and bisection are taken."""
    above = 0
    for seed in range(60):
        demand, base, dom = _problem(seed, 4, 8, 0.05, 0.0)
        pb, t, replicas = _vector(demand, base, dom)
        t2, replicas2 = quota._search_domains(pb)
        above += int((t > pb.lower).sum())
        assert t2.tolist() == t.tolist()
        assert all(a.tolist() == b.tolist() for a, b in zip(replicas, replicas2, strict=True))
    assert above >= 20


def test_domain_ids_renumbered_as_unique_does():
    for ids in ([0, 0, 1, 1], [2, 0, 1, 1, 0], [0, 2, 2], [5, 3], [-1, 4, -1], [7]):
        a = np.array(ids)
        assert quota._dense(a).tolist() == np.unique(a, return_inverse=True)[1].tolist()
        assert quota._dense(a).dtype == np.int64
