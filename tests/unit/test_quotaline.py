"""``quotaline``'s search for one domain: the smallest ``T`` where the rule succeeds, by the
rule itself tried at every ``T`` from the lower bound up (the reference), and the hint it
probes by (:func:`~expertmesh.planner.quotaline.next_failure_end`): every ``T`` before it
fails where its start fails."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import expertmesh.planner.quota as quota
from expertmesh.planner.quotaline import next_failure_end, search_one, try_quota
from expertmesh.planner.static import static_placement


def _domains(seed: int, domains: int, ranks: int, skew: float, tokens: int):
    """Per domain ``(items, receivers, lower, upper)`` as ``quota._search_domains`` makes
    them, for a random demand of about ``tokens`` a rank."""
    rng = np.random.default_rng(seed)
    num_ranks = domains * ranks
    masters, spare = int(rng.integers(1, 5)), int(rng.integers(1, 3))
    num_experts = num_ranks * masters - int(rng.integers(0, num_ranks))
    base = static_placement(num_ranks, masters + spare, num_experts, masters)
    demand = rng.multinomial(num_ranks * tokens, rng.dirichlet(np.full(num_experts, skew)))
    demand[rng.random(num_experts) < 0.2] = 0
    demand[rng.random(num_experts) < 0.1] = tokens // 8  # ties
    dom = rng.permutation(np.repeat(np.arange(domains), ranks))
    slots = masters + spare
    pb = quota._problem(demand, base.master.astype(np.int64) // slots, slots, dom, None)
    items = quota._domain_items(pb)
    ranks_, bases, free, first = pb.recv_lists
    for d, (low, high) in enumerate(zip(pb.lower.tolist(), pb.upper.tolist(), strict=True)):
        lo, hi = first[d], first[d + 1]
        recv = list(zip(ranks_[lo:hi], bases[lo:hi], free[lo:hi], strict=True))
        yield items[d], recv, low, high


_PROBLEMS = {
    "seed": st.integers(0, 10**6),
    "domains": st.integers(1, 4),
    "ranks": st.integers(1, 9),
    "skew": st.sampled_from([0.05, 0.3, 2.0]),
    "tokens": st.sampled_from([30, 200, 1000]),
}


@settings(max_examples=200, deadline=None)
@given(**_PROBLEMS)
def test_search_one_finds_the_smallest_feasible_quota(seed, domains, ranks, skew, tokens):
    for items, recv, low, high in _domains(seed, domains, ranks, skew, tokens):
        t = next((t for t in range(low, high) if try_quota(items, recv, t)[0] == 0), high)
        got, pieces, walked = search_one(items, recv, low, high)
        assert got == t
        # the static max is never tried: no rank is above it, so no piece
        assert (pieces, walked) == (try_quota(items, recv, t)[1:] if t < high else ([], []))


@settings(max_examples=200, deadline=None)
@given(**_PROBLEMS)
def test_every_quota_before_the_hint_fails_alike(seed, domains, ranks, skew, tokens):
    for items, recv, low, high in _domains(seed, domains, ranks, skew, tokens):
        for t in range(low, high):
            if try_quota(items, recv, t)[0] == 0:
                break
            ahead = next_failure_end(items, recv, t)
            assert ahead > t
            # up to the hint the shortfall falls linearly, by what it falls at t + 1
            short = [try_quota(items, recv, u)[0] for u in range(t, min(ahead, high))]
            assert all(s > 0 for s in short), (t, ahead, short)
            if len(short) > 1:
                step = short[1] - short[0]
                assert short == [short[0] + i * step for i in range(len(short))], (t, ahead)


def test_hints_reach_the_answer_in_few_probes():
    """On skewed demand where ``T`` lies above the lower bound, the hints lead there in a
    few probes (the secant steps and bisection took about 8)."""
    hops, above = 0, 0
    for seed in range(40):
        for items, recv, low, high in _domains(seed, 4, 8, 0.05, 1000):
            t, _, _ = search_one(items, recv, low, high)
            at = low
            while at < t:
                above += at == low
                at = next_failure_end(items, recv, at)
                hops += 1
            assert at == t
    assert above >= 20
    assert hops <= 2 * above
