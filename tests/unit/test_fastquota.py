"""``balance_domain``: golden example, fast == reference == ``quota_balance`` on one domain,
the replica economy's promises, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertmesh.planner import ModelSpec, Placement, fastquota, rank_tokens
from expertmesh.planner.costmodel import CostSettings
from expertmesh.planner.fastquota import (
    EXACT,
    BalanceSettings,
    balance_domain,
    replica_min_tokens,
    reuse_slots,
    route_rows,
)
from expertmesh.planner.quota import quota_balance
from expertmesh.planner.refs import quota_balance_ref
from expertmesh.planner.static import static_placement
from expertmesh.planner.topology import Link

GOLDEN_LOAD = np.array([[30, 2, 2, 2], [20, 4, 2, 2], [10, 2, 6, 2], [4, 4, 2, 10]])


def test_golden_example():
    # test_quota's golden case: demand [64, 12, 12, 16], every rank computes the mean 26
    sol = balance_domain(GOLDEN_LOAD, static_placement(4, 2, 4, 1).phy2log, EXACT)
    assert (sol.quota, sol.smallest, sol.lower_bound) == (26, 26, 26)
    assert sol.replicas.tolist() == [[1, 1, 0], [2, 1, 0], [3, 1, 0]]  # (rank, slot, expert)
    assert sol.replica_tokens.tolist() == [14, 14, 10]
    assert sol.copy_rank.tolist() == [1, 2, 3, 0] and sol.copy_expert.tolist() == [0, 0, 0, 0]
    assert sol.split.tolist() == [[0, 14, 0, 0], [2, 2, 10, 0], [2, 4, 0, 4], [26, 0, 0, 0]]
    assert sol.home_rank.tolist() == [0, 1, 2, 3]
    assert sol.rank_tokens.tolist() == [26, 26, 26, 26]


@st.composite
def domains(draw: st.DrawFn, max_ranks: int = 7) -> tuple[np.ndarray, np.ndarray, int]:
    """(counts [R_src, E], phy2log [R, S], R_src - R outside rows): homes anywhere, some
    experts not held (no tokens), skewed counts."""
    num_ranks = draw(st.integers(1, max_ranks))
    slots = draw(st.integers(1, 5))
    num_experts = draw(st.integers(1, num_ranks * slots + 2))
    cells = draw(st.permutations(range(num_ranks * slots)))
    held = draw(st.integers(0, min(num_experts, num_ranks * slots)))
    phy2log = np.full(num_ranks * slots, -1, np.int64)
    phy2log[np.array(cells[:held], np.int64)] = draw(st.permutations(range(num_experts)))[:held]
    phy2log = phy2log.reshape(num_ranks, slots)
    outside = draw(st.integers(0, 2))
    hi = draw(st.sampled_from([1, 3, 20, 500]))
    shape = (num_ranks + outside, num_experts)
    cells_ = draw(st.lists(st.integers(0, hi), min_size=shape[0] * shape[1],
                           max_size=shape[0] * shape[1]))  # fmt: skip
    counts = np.array(cells_, np.int64).reshape(shape)
    counts[:, ~np.isin(np.arange(num_experts), phy2log)] = 0
    if draw(st.booleans()):  # a hot expert
        e = draw(st.integers(0, num_experts - 1))
        counts[:, e] *= draw(st.integers(1, 20))
    counts[:, ~np.isin(np.arange(num_experts), phy2log)] = 0
    return counts, phy2log, outside


def as_quota_case(
    counts: np.ndarray, phy2log: np.ndarray
) -> tuple[np.ndarray, Placement, np.ndarray]:
    """The same problem for ``quota_balance``: every expert mastered (unheld ones in
    slots of extra rows, domain 1), outside sources as ranks of domain 1."""
    num_src, num_experts = counts.shape
    num_ranks, slots = phy2log.shape
    extra_rows = max(num_src - num_ranks, 0) + num_experts  # room for every unheld expert
    p2l = np.full((num_ranks + extra_rows, slots), -1, np.int64)
    p2l[:num_ranks] = phy2log
    unheld = np.flatnonzero(~np.isin(np.arange(num_experts), phy2log))
    p2l[num_ranks + np.arange(unheld.size), 0] = unheld
    master = np.zeros(num_experts, np.int64)
    r, s = np.nonzero(p2l >= 0)
    master[p2l[r, s]] = r * slots + s
    load = np.zeros((p2l.shape[0], num_experts), np.int64)
    load[:num_src] = counts
    domain = np.r_[np.zeros(num_ranks, np.int64), np.ones(extra_rows, np.int64)]
    return load, Placement(p2l.astype(np.int32), master), domain


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    domains(),
    st.sampled_from([None, None, 1, 2]),
    st.sampled_from([0.0, 0.0, 0.02, 0.3]),
    st.sampled_from([0.0, 0.0, 0.05, 0.3]),
)
def test_fast_equals_reference_and_quota(case, max_rep, tol, share):
    counts, phy2log, _ = case
    num_ranks = phy2log.shape[0]
    econ = BalanceSettings(max_replicas_per_expert=max_rep, tolerance=tol, min_replica_share=share)
    sol = balance_domain(counts, phy2log, econ)
    load, masters, domain = as_quota_case(counts, phy2log)
    old = quota_balance(load, masters, domain, max_rep, tolerance=tol, min_replica_share=share)
    assert sol.quota == old.quota[0]
    assert sol.lower_bound == old.lower_bound[0]
    rows = route_rows(sol, counts)
    assert sorted(rows.tolist()) == sorted(old.route.tolist())
    after = phy2log.copy()
    after[sol.replicas[:, 0], sol.replicas[:, 1]] = sol.replicas[:, 2]
    assert np.array_equal(after, old.placement.phy2log[:num_ranks])
    if max_rep is None and tol == share == 0:  # the reference's linear scan: the same T
        quotas, ref_p2l, ref_route = quota_balance_ref(load, masters, domain)
        assert sol.quota == quotas[0]
        assert np.array_equal(after, ref_p2l[:num_ranks])
        assert sorted(rows.tolist()) == sorted(ref_route.tolist())
    assert np.array_equal(sol.rank_tokens, rank_tokens(rows, load.shape[0])[:num_ranks])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    domains(),
    st.sampled_from([0.0, 0.01, 0.05, 0.3]),
    st.sampled_from([0, 1, 5, 50]),
    st.sampled_from([0.0, 0.0, 0.02, 0.2]),
)
def test_economy_settings_keep_their_promises(case, tol, least, share):
    counts, phy2log, _ = case
    num_ranks = phy2log.shape[0]
    econ = BalanceSettings(tolerance=tol, min_tokens_per_replica=least, min_replica_share=share)
    held = np.isin(np.arange(counts.shape[1]), phy2log)
    least = max(least, math.ceil(share * counts[:, held].sum() / num_ranks))
    sol = balance_domain(counts, phy2log, econ)
    exact = balance_domain(counts, phy2log, EXACT)
    assert sol.smallest == exact.quota
    assert exact.quota <= sol.quota <= max(int(exact.quota * (1 + tol)), exact.quota)
    assert sol.replicas.shape[0] <= exact.replicas.shape[0]
    assert (sol.replica_tokens >= least).all()
    # every token routed once, only to a copy in its slot, copies in free slots only
    rows = route_rows(sol, counts)
    routed = np.zeros_like(counts)
    np.add.at(routed, (rows[:, 0], rows[:, 1]), rows[:, 3])
    assert np.array_equal(routed, counts)
    after = phy2log.copy()
    assert (after[sol.replicas[:, 0], sol.replicas[:, 1]] == -1).all()
    after[sol.replicas[:, 0], sol.replicas[:, 1]] = sol.replicas[:, 2]
    holds = np.zeros((num_ranks, counts.shape[1]), bool)
    r, s = np.nonzero(after >= 0)
    holds[r, after[r, s]] = True
    assert holds[rows[:, 2], rows[:, 1]].all()
    assert r.size == holds.sum()  # no rank holds an expert twice
    per_rank = rank_tokens(rows, counts.shape[0])[:num_ranks]
    assert np.array_equal(sol.rank_tokens, per_rank)
    # the T used holds but for the tokens of replicas not made (< least each)
    dropped = exact.replicas.shape[0] if least else 0
    assert per_rank.max(initial=0) <= sol.quota + dropped * max(least - 1, 0)
    if least == 0:
        assert per_rank.max(initial=0) == sol.quota or sol.replicas.shape[0] == 0


def test_tolerance_trades_a_little_balance_for_fewer_replicas():
    rng = np.random.default_rng(5)
    skew = rng.zipf(1.5, size=32).clip(max=60).astype(np.int64)
    counts = rng.poisson(40 * skew, size=(8, 32)).astype(np.int64)
    phy2log = static_placement(8, 6, 32, 4).phy2log
    exact = balance_domain(counts, phy2log, EXACT)
    loose = balance_domain(counts, phy2log, BalanceSettings(tolerance=0.05))
    assert loose.replicas.shape[0] < exact.replicas.shape[0]
    assert loose.rank_tokens.max() <= 1.05 * exact.rank_tokens.max()


def test_min_replica_share_drops_the_small_replicas():
    rng = np.random.default_rng(7)
    counts = rng.poisson(50 * rng.zipf(1.4, size=32).clip(max=80), size=(8, 32)).astype(np.int64)
    phy2log = static_placement(8, 6, 32, 4).phy2log
    exact = balance_domain(counts, phy2log, EXACT)
    least = math.ceil(0.1 * counts.sum() / 8)
    assert (exact.replica_tokens < least).any()  # the case has small replicas
    econ = balance_domain(counts, phy2log, BalanceSettings(min_replica_share=0.1))
    assert econ.replica_tokens.tolist() == [t for t in exact.replica_tokens if t >= least]
    assert econ.quota == exact.quota


def test_replica_break_even_by_the_cost_model():
    model = ModelSpec(hidden=1024, ffn_hidden=512)  # 1.5M params, bf16
    link = Link(gbps=8, latency_ms=1.0)  # 1 GB/s
    cost = CostSettings(flops_per_second=1e12)
    # training: weights + gradient (6 MiB-ish) over 1 GB/s + 1 ms, against 6 * params / 1e12
    params = 3 * 1024 * 512
    seconds = 1e-3 + 2 * params * 2 / 1e9
    assert replica_min_tokens(model, link, cost) == math.ceil(seconds / (6 * params / 1e12))
    fwd = model.model_copy(update={"training": False})
    assert replica_min_tokens(fwd, link, cost) == math.ceil(
        (1e-3 + 2 * params / 1e9) / (2 * params / 1e12)
    )
    assert replica_min_tokens(model, Link(gbps=80, latency_ms=1.0), cost) < replica_min_tokens(
        model, link, cost
    )


def test_replicas_that_repeat_keep_the_slot_that_holds_their_weights():
    rng = np.random.default_rng(11)
    phy2log = static_placement(8, 6, 32, 4).phy2log
    skew = rng.zipf(1.4, size=32).clip(max=80)
    first = rng.poisson(50 * skew, size=(8, 32)).astype(np.int64)
    second = rng.poisson(50 * skew * rng.uniform(0.5, 1.5, 32), size=(8, 32)).astype(np.int64)
    a = balance_domain(first, phy2log, EXACT)
    cached = phy2log.copy()
    cached[a.replicas[:, 0], a.replicas[:, 1]] = a.replicas[:, 2]
    b = balance_domain(second, phy2log, EXACT)
    seated, fresh = reuse_slots(b.replicas, phy2log, cached)
    assert np.array_equal(seated[:, [0, 2]], b.replicas[:, [0, 2]])  # same ranks, experts
    again = {(r, e) for r, _, e in a.replicas.tolist()}
    repeat = np.array([(r, e) in again for r, _, e in b.replicas.tolist()])
    assert repeat.any() and not repeat.all()  # the case has both kinds
    assert np.array_equal(fresh, ~repeat)
    assert (cached[seated[~fresh, 0], seated[~fresh, 1]] == seated[~fresh, 2]).all()
    assert (phy2log[seated[:, 0], seated[:, 1]] == -1).all()  # free slots only
    assert len({(r, s) for r, s, _ in seated.tolist()}) == len(seated)  # one replica a slot
    nothing = reuse_slots(b.replicas, phy2log, phy2log)  # no cache: lowest free slots
    assert np.array_equal(nothing[0], b.replicas) and nothing[1].all()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(domains(max_ranks=12), st.sampled_from([None, 1]), st.sampled_from([0.0, 0.05]))
def test_the_list_and_numpy_setups_agree(case, max_rep, tol):
    counts, phy2log, _ = case
    econ = BalanceSettings(max_replicas_per_expert=max_rep, tolerance=tol, min_replica_share=0.01)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fastquota, "SMALL_DOMAIN_SLOTS", 10**9)
        lists = balance_domain(counts, phy2log, econ)
        mp.setattr(fastquota, "SMALL_DOMAIN_SLOTS", -1)
        arrays = balance_domain(counts, phy2log, econ)
    assert (lists.quota, lists.smallest, lists.lower_bound) == (
        arrays.quota,
        arrays.smallest,
        arrays.lower_bound,
    )
    for f in ("replicas", "replica_tokens", "home_rank", "copy_rank", "split", "rank_tokens"):
        assert np.array_equal(getattr(lists, f), getattr(arrays, f)), f


@pytest.mark.parametrize("small", [10**9, -1])
def test_bad_input_is_a_value_error(small, monkeypatch):
    monkeypatch.setattr(fastquota, "SMALL_DOMAIN_SLOTS", small)
    p2l = static_placement(4, 2, 4, 1).phy2log
    with pytest.raises(ValueError, match="source rows"):
        balance_domain(GOLDEN_LOAD[:3], p2l)
    with pytest.raises(ValueError, match="negative"):
        balance_domain(-GOLDEN_LOAD, p2l)
    with pytest.raises(ValueError, match="integer"):
        balance_domain(GOLDEN_LOAD.astype(float), p2l)
    with pytest.raises(ValueError, match="twice"):
        balance_domain(GOLDEN_LOAD, np.array([[0, 0], [1, -1], [2, -1], [3, -1]]))
    with pytest.raises(ValueError, match="does not hold"):
        balance_domain(GOLDEN_LOAD, np.array([[0, -1], [1, -1], [2, -1], [-1, -1]]))
    with pytest.raises(ValueError, match="outside"):
        balance_domain(GOLDEN_LOAD, np.array([[0, 9], [1, -1], [2, -1], [3, -1]]))
    with pytest.raises(ValueError, match="2\\^31"):
        balance_domain(GOLDEN_LOAD * (1 << 30), p2l)
    with pytest.raises(ValueError):
        BalanceSettings(tolerance=-0.1)
