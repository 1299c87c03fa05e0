"""The torch solve of one domain equals the numpy one (same replicas, same per-(source,
expert, copy) tokens) on many random loads; the worker's entry point picks by input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertmesh.planner.fastquota import (
    DEFAULTS,
    EXACT,
    BalanceSettings,
    DomainBalance,
    balance_domain,
)
from expertmesh.planner.static import static_placement
from expertmesh.workers.quota_torch import TorchBalance, balance, balance_torch

FIELDS = ("replicas", "replica_tokens", "home_rank", "copy_rank", "copy_expert", "split",
          "rank_tokens")  # fmt: skip


def assert_same(a: DomainBalance, b: DomainBalance) -> None:
    assert (a.quota, a.smallest, a.lower_bound) == (b.quota, b.smallest, b.lower_bound)
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype == np.int64, f
        assert np.array_equal(x, y), f


@st.composite
def loads(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, BalanceSettings]:
    """A domain of 1-12 ranks, homes anywhere, skewed counts (Zipf-like), outside rows."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    num_ranks = draw(st.integers(1, 12))
    masters, spare = draw(st.integers(1, 4)), draw(st.integers(0, 3))
    slots = masters + spare
    num_experts = draw(st.integers(1, num_ranks * masters))
    cells = rng.permutation(num_ranks * slots)[:num_experts]
    phy2log = np.full(num_ranks * slots, -1, np.int64)
    phy2log[cells] = np.arange(num_experts)
    outside = draw(st.integers(0, 3))
    skew = rng.zipf(draw(st.sampled_from([1.3, 1.8, 3.0])), size=num_experts).clip(max=200)
    counts = rng.poisson(draw(st.sampled_from([1, 10, 300])) * skew,
                         size=(num_ranks + outside, num_experts)).astype(np.int64)  # fmt: skip
    econ = BalanceSettings(
        tolerance=draw(st.sampled_from([0.0, 0.0, 0.02])),
        min_tokens_per_replica=draw(st.sampled_from([0, 0, 8])),
        max_replicas_per_expert=draw(st.sampled_from([None, None, 1, 2])),
    )
    return counts, phy2log.reshape(num_ranks, slots), econ


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loads(), st.sampled_from([torch.int64, torch.int32]))
def test_torch_equals_numpy(case, dtype):
    counts, phy2log, econ = case
    want = balance_domain(counts, phy2log, econ)
    got = balance_torch(torch.from_numpy(counts).to(dtype), torch.from_numpy(phy2log), econ)
    assert isinstance(got, TorchBalance)
    assert got.split.device == torch.device("cpu") and got.split.dtype == torch.int64
    assert_same(got.numpy(), want)
    again = balance_torch(torch.from_numpy(counts), torch.from_numpy(phy2log), econ)
    assert_same(again.numpy(), want)  # deterministic


def test_an_ep64_like_load_is_equal_and_balanced():
    rng = np.random.default_rng(1)
    skew = rng.zipf(1.4, size=256).clip(max=400)
    counts = rng.poisson(60 * skew, size=(64, 256)).astype(np.int64)
    phy2log = static_placement(64, 6, 256, 4).phy2log
    for econ in (EXACT, DEFAULTS):
        want = balance_domain(counts, phy2log, econ)
        assert want.replicas.shape[0] > 20  # the case does balance
        got = balance_torch(torch.from_numpy(counts), torch.from_numpy(phy2log), econ)
        assert_same(got.numpy(), want)
    exact = balance_domain(counts, phy2log, EXACT)
    assert exact.rank_tokens.max() == exact.quota
    assert want.replicas.shape[0] < exact.replicas.shape[0]  # the defaults save replicas


def test_entry_point_picks_by_input():
    counts = np.array([[30, 2, 2, 2], [20, 4, 2, 2], [10, 2, 6, 2], [4, 4, 2, 10]])
    p2l = static_placement(4, 2, 4, 1).phy2log
    ref = balance_domain(counts, p2l)
    as_np = balance(counts, p2l)
    assert isinstance(as_np, DomainBalance)
    assert_same(as_np, ref)
    for impl in ("auto", "numpy", "torch"):
        out = balance(torch.from_numpy(counts), torch.from_numpy(p2l), impl=impl)
        assert isinstance(out, TorchBalance)
        assert_same(out.numpy(), ref)
    assert isinstance(balance(counts, p2l, impl="torch"), TorchBalance)
    with pytest.raises(ValueError, match="impl"):
        balance(counts, p2l, impl="gpu")  # type: ignore[arg-type]


def test_bad_tensors_are_value_errors():
    p2l = torch.from_numpy(static_placement(4, 2, 4, 1).phy2log)
    good = torch.ones((4, 4), dtype=torch.int64)
    with pytest.raises(ValueError, match="integer"):
        balance_torch(good.float(), p2l)
    with pytest.raises(ValueError, match="source rows"):
        balance_torch(good[:3], p2l)
    with pytest.raises(ValueError, match="negative"):
        balance_torch(-good, p2l)
    with pytest.raises(ValueError, match="twice"):
        balance_torch(good, torch.tensor([[0, 0], [1, -1], [2, -1], [3, -1]]))
    with pytest.raises(ValueError, match="outside"):
        balance_torch(good, torch.tensor([[0, 7], [1, -1], [2, -1], [3, -1]]))
