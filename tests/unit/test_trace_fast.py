"""The trace generator's fast paths give the same floats and draws as the plain steps they
replace: the fused systematic sampler (integer keys instead of a stable argsort of the arc
starts) and the calibration memo shared by a trace's steps."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.planner.trace import (
    _calibrate,
    _drift,
    _expert_rank,
    _Memo,
    _sample,
    _systematic_sample,
    counts_from_segments,
    inclusion_probabilities,
    systematic_arcs,
)


def plain_systematic(rng: np.random.Generator, q: np.ndarray, n: int) -> np.ndarray:
    """The plain steps: arcs, stable argsort of the starts, multinomial over the segments."""
    start, end = systematic_arcs(q)
    by_start = np.argsort(start, axis=1, kind="stable")
    rows = np.arange(q.shape[0])[:, None]
    seg = np.diff(start[rows, by_start], axis=1, append=1.0)
    seg = np.maximum(seg, 0.0)
    seg /= seg.sum(axis=1, keepdims=True)
    seg_counts = rng.multinomial(n, seg)
    return counts_from_segments(start, end, q, seg_counts, n, order=by_start)


def plain_sample(rng: np.random.Generator, pi: np.ndarray, n: int, num_src: int) -> np.ndarray:
    out = np.zeros((num_src, pi.shape[0]), dtype=np.int64)
    full = pi >= 1.0 - 1e-12
    out[:, full] = n
    idx = np.flatnonzero(~full)
    if idx.size == 0 or pi[idx].sum() < 0.5:
        return out
    order = rng.permuted(np.tile(idx, (num_src, 1)), axis=1)
    out[np.arange(num_src)[:, None], order] = plain_systematic(rng, pi[order], n)
    return out


def awkward_q(rng: np.random.Generator, rows: int, items: int, k: int, kind: str) -> np.ndarray:
    """[rows, items] inclusion probabilities summing to k per row, < 1 each; ``kind`` adds
    what the sorting and the arc ends must get right: equal starts and arcs of length 0
    (``tiny`` items), arcs that end exactly where the circle wraps (``grid``: multiples of
    1/8, each row's running sum hits integers)."""
    if kind == "grid" and 8 * k <= 7 * items and k <= items:
        eighths = np.ones((rows, items), dtype=np.int64)
        for r in range(rows):  # 8 k eighths over the items, at most 7 each
            for i in rng.permutation(np.repeat(np.arange(items), 6))[: 8 * k - items]:
                eighths[r, i] += 1
        return eighths / 8.0
    w = rng.uniform(0.2, 1.0, size=(rows, items))
    if kind == "tiny":  # items of ~1e-17: equal arc starts, arcs of length 0
        w[rng.random((rows, items)) < 0.3] = 1e-17
    q = k * w / w.sum(axis=1, keepdims=True)
    q = np.minimum(q, 0.999)
    q *= k / q.sum(axis=1, keepdims=True)
    return q


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 9),
    items=st.integers(2, 70),
    k=st.integers(1, 8),
    n=st.sampled_from([1, 2, 7, 300, 8192]),
    kind=st.sampled_from(["plain", "tiny", "grid"]),
)
def test_fused_sampler_equals_the_plain_steps(seed, rows, items, k, n, kind):
    k = min(k, items - 1)
    q = awkward_q(np.random.default_rng(seed), rows, items, k, kind)
    if (q >= 1).any():
        return
    a_rng, b_rng = np.random.default_rng(seed + 1), np.random.default_rng(seed + 1)
    fast = _systematic_sample(a_rng, q, n)
    assert np.array_equal(fast, plain_systematic(b_rng, q, n))
    assert a_rng.random() == b_rng.random()  # the same draws were taken


def test_fused_sampler_covers_ties_and_wraps():
    # The property test's awkward rows do occur: equal starts, zero-length arcs, arcs that
    # end exactly at the wrap (checked here so that the property test cannot pass vacuously).
    for kind in ("tiny", "grid"):
        q = awkward_q(np.random.default_rng(3), 40, 30, 4, kind)
        start, end = systematic_arcs(q)
        assert (np.diff(np.sort(start, axis=1), axis=1) == 0).any(), kind
        assert (end < start).any(), kind
        if kind == "tiny":
            assert (end == start).any()
        a, b = np.random.default_rng(0), np.random.default_rng(0)
        assert np.array_equal(_systematic_sample(a, q, 64), plain_systematic(b, q, 64))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    experts=st.integers(1, 80),
    ranks=st.integers(1, 12),
    k=st.integers(1, 8),
    n=st.sampled_from([1, 5, 2048]),
    capped=st.booleans(),
)
def test_sample_equals_the_plain_sampler(seed, experts, ranks, k, n, capped):
    k = min(k, experts)
    rng = np.random.default_rng(seed)
    w = np.sort(rng.uniform(0.01, 1.0, experts))[::-1]
    if capped:
        w[: k // 2] = 1e6  # experts every token picks (pi == 1)
    pi = inclusion_probabilities(w, k)[rng.permutation(experts)]
    a, b = np.random.default_rng(seed + 1), np.random.default_rng(seed + 1)
    buffer = np.full((ranks, experts), -7, dtype=np.int64)
    fast = _sample(a, pi, n, ranks, out=buffer)
    assert fast is buffer
    assert np.array_equal(fast, plain_sample(b, pi, n, ranks))
    assert a.random() == b.random()


def drifted_orders(seed: int, experts: int, steps: int, drift: float) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    perm = rng.permutation(experts)
    orders = [perm.copy()]
    for _ in range(steps - 1):
        _drift(rng, perm, drift)
        orders.append(perm.copy())
    return orders


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    experts=st.integers(2, 300),
    ranks=st.sampled_from([None, 1, 3, 16]),
    k=st.integers(1, 9),
    target=st.floats(1.0, 6.0),
)
def test_memo_calibration_is_the_same_floats(seed, experts, ranks, k, target):
    # the memo shared by a trace's steps changes nothing: exponent, imbalance and pi equal
    # a fresh calibration's (also with several experts per rank, where no comparison may
    # come from the memo), and errors stay errors
    k = min(k, experts)
    ranks = experts if ranks is None else ranks
    er = _expert_rank(ranks, experts)
    memo = _Memo(er, ranks, experts)
    for perm in drifted_orders(seed, experts, 8, 0.3):
        try:
            want = _calibrate(perm, er, ranks, k, target)
        except ValueError as err:
            try:
                _calibrate(perm, er, ranks, k, target, memo=memo)
            except ValueError as err2:
                assert str(err2) == str(err)
                continue
            raise AssertionError("the memo calibrated what plain calibration refuses") from err
        got = _calibrate(perm, er, ranks, k, target, memo=memo)
        assert got[:2] == want[:2]
        assert np.array_equal(got[2], want[2])


def test_memo_settles_on_the_scale_runs_calibration():
    # one expert per reference rank (the sweeps' default): after the first steps no
    # comparison needs computing, yet every step's result equals a fresh calibration's;
    # with several experts per rank the memo never decides a comparison
    er = _expert_rank(256, 256)
    memo = _Memo(er, 256, 256)
    orders = drifted_orders(5, 256, 30, 0.02)
    for perm in orders:
        want = _calibrate(perm, er, 256, 8, 2.0)
        got = _calibrate(perm, er, 256, 8, 2.0, memo=memo)
        assert got[:2] == want[:2] and np.array_equal(got[2], want[2])
    assert memo.settled is not None
    er4 = _expert_rank(64, 256)
    memo4 = _Memo(er4, 64, 256)
    for perm in orders[:5]:
        want = _calibrate(perm, er4, 64, 8, 3.0)
        assert _calibrate(perm, er4, 64, 8, 3.0, memo=memo4)[:2] == want[:2]
    assert memo4.settled is None and not memo4.known


def test_memo_computes_comparisons_the_order_can_flip():
    # With one expert per rank the order moves the imbalance only by rounding (well inside
    # the memo's slack); a comparison with a threshold inside that slack of a known value
    # must be computed under the new order, not taken from the memo.
    from expertmesh.planner.trace import _Imbalance

    er = _expert_rank(256, 256)
    s = 0.731
    rng = np.random.default_rng(0)
    values = {}
    for _ in range(200):
        perm = rng.permutation(256)
        values[_Imbalance(perm, er, 256, 8)(s)] = perm
    low, high = min(values), max(values)
    assert low < high  # orders do move it (by rounding) ...
    assert (high - low) / low < _Memo(er, 256, 256).slack / 4  # ... far less than the slack
    memo = _Memo(er, 256, 256)
    assert _Imbalance(values[high], er, 256, 8, memo)(s) == high  # known[s] = high
    f = _Imbalance(values[low], er, 256, 8, memo)
    assert f.below(s, high) and f.decided  # computed: low < high, though known == high
    g = _Imbalance(values[low], er, 256, 8, memo)
    assert not g.below(s, high * (1 - 4 * memo.slack)) and not g.decided  # from the memo
