"""``eplb``: DeepSeek EPLB's algorithms (golden, reference, peer) and the policy's invariants."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertmesh.planner.eplb import _rebalance, rebalance
from expertmesh.planner.refs import eplb_rebalance_ref

# DeepSeek EPLB README (github.com/deepseek-ai/EPLB, README.md at d52c72d, "Interface and
# Example"): two layers of 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs.
README_WEIGHT = np.array(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]


def test_readme_example_is_reproduced_exactly():
    phy2log, log2phy, logcnt = rebalance(README_WEIGHT, 16, 4, 2, 8, hierarchical=True)
    assert phy2log.tolist() == README_PHY2LOG
    # the README's picture: experts 10, 5, 1, 4 of layer 0 have two copies
    assert logcnt[0].tolist() == [1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]
    for layer in range(2):
        for e in range(12):
            phys = log2phy[layer, e][log2phy[layer, e] >= 0]
            assert len(phys) == logcnt[layer, e]
            assert (phy2log[layer, phys] == e).all()


@st.composite
def problems(draw: st.DrawFn) -> tuple[tuple[np.ndarray, int, int, int, int], bool]:
    nodes = draw(st.integers(1, 4))
    gpus = nodes * draw(st.integers(1, 4))
    groups = nodes * draw(st.integers(1, 3))
    experts = groups * draw(st.integers(1, 4))
    per_gpu = -(-experts // gpus) + draw(st.integers(0, 3))
    layers = draw(st.integers(1, 3))
    hi = draw(st.sampled_from([0, 3, 30, 10**6]))  # small ranges give many ties
    weight = np.array(
        draw(st.lists(st.integers(0, hi), min_size=layers * experts, max_size=layers * experts))
    ).reshape(layers, experts)
    return (weight, gpus * per_gpu, groups, nodes, gpus), draw(st.booleans())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_fast_equals_reference(problem):
    args, hier = problem
    ref = eplb_rebalance_ref(*args, hierarchical=hier)
    fast = rebalance(*args, hierarchical=hier)
    rows = _rebalance(*args, hierarchical=hier, vector_rows=1)  # numpy-rows packing
    for got in (fast, rows):
        assert np.array_equal(got[0], ref[0])  # phy2log
        assert np.array_equal(got[-1], ref[2])  # logcnt
    assert np.array_equal(fast[1], ref[1])  # log2phy
    weight, replicas = args[0], args[1]
    assert (ref[2] >= 1).all() and (ref[2].sum(1) == replicas).all()
    for layer in range(weight.shape[0]):
        assert np.array_equal(np.bincount(ref[0][layer], minlength=weight.shape[1]), ref[2][layer])


def test_vectorized_rows_path_matches_reference_at_scale():
    weight = np.random.default_rng(3).integers(0, 1000, size=(40, 32))
    args = (weight, 48, 8, 4, 16)  # 160 (layer, node) rows: the numpy-rows packing
    ref = eplb_rebalance_ref(*args, hierarchical=True)
    got = rebalance(*args, hierarchical=True)
    assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1])


def test_replicas_follow_load():
    phy2log, _, logcnt = rebalance(np.array([[1000, 1, 1, 1]]), 8, 1, 1, 4, hierarchical=False)
    assert logcnt[0].tolist() == [5, 1, 1, 1]
    # five copies of 200, three of 1 into four GPUs of two slots, heaviest first
    per_slot = np.array([1000, 1, 1, 1])[phy2log[0]] / logcnt[0][phy2log[0]]
    assert per_slot.reshape(4, 2).sum(1).tolist() == [400, 201, 201, 201]


def test_all_zero_weight_is_valid():
    _, _, logcnt = rebalance(np.zeros((1, 4)), 8, 2, 2, 4, hierarchical=True)
    assert logcnt.sum() == 8 and (logcnt >= 1).all()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((np.ones(4), 8, 1, 1, 4), "must be a non-empty"),
        ((-np.ones((1, 4)), 8, 1, 1, 4), "non-negative"),
        ((np.ones((1, 4)), 8, 3, 1, 4), "do not split into 3 groups"),
        ((np.ones((1, 4)), 8, 2, 4, 4), "groups do not split over"),
        ((np.ones((1, 4)), 8, 2, 2, 3), "GPUs do not split"),
        ((np.ones((1, 4)), 6, 1, 1, 4), "replicas do not split"),
        ((np.ones((1, 8)), 4, 1, 1, 4), "cannot hold 8 experts"),
        # finite as float64, inf as float32 (#15 item 13: numpy's "repeats may not contain
        # negative values" surfaced instead)
        ((np.array([[1e39, 1.0, 1.0, 1.0]]), 8, 1, 1, 4), "beyond float32"),
        ((np.full((1, 4), 3e38), 8, 1, 1, 4), "beyond float32"),  # each fits, the sum not
    ],
)
def test_bad_arguments_are_value_errors(args, match):
    with pytest.raises(ValueError, match=match):
        rebalance(*args, hierarchical=True)
    if match == "beyond float32":
        with pytest.raises(ValueError, match=match):
            rebalance(*args, hierarchical=False)


def test_large_finite_weights_still_plan():
    w = np.array([[8e37, 1e37, 1e37, 1e37]])  # sums to 1.1e38 < float32's 3.4e38
    _, _, logcnt = rebalance(w, 8, 1, 1, 4, hierarchical=False)
    assert logcnt.sum() == 8 and logcnt[0, 0] == logcnt.max() and logcnt[0, 0] >= 4


def test_matches_peer_deepseek_eplb(peer_eplb: ModuleType):
    """Same phy2log and logcnt as DeepSeek's code on random inputs without ties (the
    peer sorts with an unstable sort, so ties may go either way there)."""
    import torch

    rng = np.random.default_rng(0)
    shapes = [(12, 16, 4, 2, 8), (256, 384, 8, 8, 64), (256, 384, 32, 8, 64), (64, 96, 8, 4, 16)]
    for trial in range(24):
        experts, replicas, groups, nodes, gpus = shapes[trial % len(shapes)]
        weight = rng.permutation(10**6)[: 3 * experts].reshape(3, experts)  # distinct values
        hierarchical = trial % 3 != 0
        ours = rebalance(weight, replicas, groups, nodes, gpus, hierarchical=hierarchical)
        theirs = [
            t.numpy()
            for t in peer_eplb.rebalance_experts(
                torch.from_numpy(weight), replicas, groups, nodes, gpus, hierarchical
            )
        ]
        assert np.array_equal(ours[0], theirs[0]), (trial, hierarchical)
        assert np.array_equal(ours[2], theirs[2])
        # log2phy: the same physical experts per logical expert (replica ranks of copies
        # that tie in weight may be numbered either way by the unstable sort)
        assert np.array_equal(np.sort(ours[1], -1), np.sort(theirs[1], -1))
