"""The expert-parallel step equals a single-process reference MoE, for any plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.planner import Placement, Topology
from expertmesh.planner.plan import Migration
from expertmesh.planner.static import static_placement
from expertmesh.planner.stepmodel import StepLayout, step_layout
from expertmesh.workers.engine import (
    BACKWARD,
    FORWARD,
    LocalExecutor,
    apply_plan,
    migration_rounds,
    step_phases,
    train_step,
)
from expertmesh.workers.model import Corpus, DenseModel, LMConfig, init_expert
from expertmesh.workers.moe import assign_destinations, largest_remainder, reference_moe
from expertmesh.workers.rank import LayerState, RankState, from_wire, to_wire

CFG = LMConfig(
    num_layers=2, num_experts=6, top_k=2, hidden=8, ffn_hidden=8, seq_len=8, batch=2, seed=3
)
CORPUS = Corpus(bytes(range(256)) * 8 + b"the quick brown fox jumps over the lazy dog " * 40)


def _topology() -> Topology:
    return Topology.generate(3, 2, masters=1, spare=3)


def random_plan(rng: np.random.Generator, topo: Topology, num_experts: int) -> tuple:
    """Random placement (every expert >= 1 copy, random replicas, random master) and a
    random route with random shares over the holders."""
    num_ranks, slots = topo.num_ranks, topo.slots_per_rank
    phy2log = np.full((num_ranks, slots), -1, np.int32)
    for e in range(num_experts):  # one copy each, on a rank with room
        free = [r for r in range(num_ranks) if (phy2log[r] < 0).any()]
        r = int(rng.choice(free))
        phy2log[r, np.flatnonzero(phy2log[r] < 0)[0]] = e
    for r in range(num_ranks):
        for s in np.flatnonzero(phy2log[r] < 0):
            if rng.random() < 0.7:
                missing = [e for e in range(num_experts) if e not in phy2log[r]]
                if missing:
                    phy2log[r, s] = int(rng.choice(missing))
    master = np.empty(num_experts, np.int64)
    for e in range(num_experts):
        master[e] = int(rng.choice(np.flatnonzero(phy2log.ravel() == e)))
    placement = Placement(phy2log, master)
    holds = placement.holds()
    rows = []
    for src in range(num_ranks):
        for e in range(num_experts):
            if rng.random() < 0.2:
                continue  # the plan did not see (src, e): fallback routing
            for dst in np.flatnonzero(holds[:, e]):
                rows.append((src, e, int(dst), int(rng.integers(0, 5))))
    return placement, np.array(rows, np.int64).reshape(-1, 4)


def _ranks(topo: Topology, placement: Placement, route: np.ndarray) -> list[RankState]:
    ranks = [
        RankState(r, topo, CFG, CORPUS, [placement] * CFG.num_layers) for r in range(topo.num_ranks)
    ]
    for rs in ranks:
        rs.layers = [LayerState(placement, route) for _ in range(CFG.num_layers)]
    return ranks


def _forward_backward(ex: LocalExecutor, step: int) -> None:
    outs = ex.phase("begin", 0, None, step)
    for layer in range(CFG.num_layers):
        for name in FORWARD:
            outs = ex.phase(name, layer, outs)
    for layer in reversed(range(CFG.num_layers)):
        for name in BACKWARD:
            outs = ex.phase(name, layer, outs)


def _reference(num_ranks: int, step: int) -> tuple[list[float], DenseModel, dict]:
    """Loss of every rank, dense grads and expert grads of one single-process step."""
    dense = DenseModel(CFG)
    experts = {
        (layer, e): tuple(t.clone().requires_grad_(True) for t in init_expert(CFG, layer, e))
        for layer in range(CFG.num_layers)
        for e in range(CFG.num_experts)
    }
    losses = []
    total = CFG.tokens_per_rank * num_ranks
    for r in range(num_ranks):
        x, y = CORPUS.batch(CFG, step, r)
        h = dense.embed(x)
        for layer in range(CFG.num_layers):
            a, u = dense.mix(layer, h)
            idx, w = dense.gate(layer, u)
            ws = {e: experts[(layer, e)] for e in range(CFG.num_experts)}
            h = a + reference_moe(u, idx, w, ws).reshape(a.shape)  # type: ignore[arg-type]
        loss = dense.loss_sum(h, y) / total
        loss.backward()
        losses.append(float(loss.detach()))
    return losses, dense, experts


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_step_equals_reference_for_random_plans(seed: int) -> None:
    topo = _topology()
    placement, route = random_plan(np.random.default_rng(seed), topo, CFG.num_experts)
    ranks = _ranks(topo, placement, route)
    _forward_backward(LocalExecutor(ranks), 0)
    ref_losses, dense, experts = _reference(topo.num_ranks, 0)
    np.testing.assert_allclose([r.loss_sum for r in ranks], ref_losses, rtol=1e-5, atol=1e-6)
    for i, p in enumerate(dense.parameters()):
        got = sum(list(rs.dense.parameters())[i].grad for rs in ranks)
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6)
    for (layer, e), w in experts.items():
        grads = [rs.experts[layer][e] for rs in ranks if e in rs.experts[layer]]
        for j in range(3):
            got = sum(g[j].grad for g in grads if g[j].grad is not None)
            torch.testing.assert_close(got, w[j].grad, rtol=1e-4, atol=1e-6)


def test_hierarchical_dispatch_crosses_each_dc_pair_once_per_token() -> None:
    topo = _topology()
    placement = static_placement(topo.num_ranks, topo.slots_per_rank, 6, topo.masters_per_rank)
    ranks = _ranks(topo, placement, np.zeros((0, 4), np.int64))
    ex = LocalExecutor(ranks)
    ex.phase("begin", 0, None, 0)
    n, d = CFG.tokens_per_rank, CFG.hidden
    for rs in ranks:
        sent = rs._src[0]["sent"]
        for dest, (uniq, _) in sent.items():
            if topo.rank_dc[dest] != rs.dc:
                assert len(torch.unique(uniq)) == len(uniq) <= n
        # tokens bytes leaving this rank's DC: at most one row per token per remote DC
        out_rows = rs.bytes[0, rs.dc].sum() / 4
        assert out_rows <= (topo.num_dcs - 1) * n * (d + 3 * CFG.top_k) + 1


def test_training_with_plan_changes_matches_static() -> None:
    topo = _topology()
    static = static_placement(topo.num_ranks, topo.slots_per_rank, 6, topo.masters_per_rank)
    none = np.zeros((0, 4), np.int64)
    base = LocalExecutor(_ranks(topo, static, none))
    moved = LocalExecutor(_ranks(topo, static, none))
    rng = np.random.default_rng(7)
    current = [static] * CFG.num_layers
    losses_a, losses_b = [], []
    for step in range(4):
        losses_a.append(sum(s["loss"] for s in train_step(base, step, CFG.num_layers)))
        losses_b.append(sum(s["loss"] for s in train_step(moved, step, CFG.num_layers)))
        new, routes = zip(*(random_plan(rng, topo, 6) for _ in range(CFG.num_layers)), strict=True)
        rounds = migration_rounds(current, list(new), [Migration()] * CFG.num_layers, topo)
        layers = [(p.phy2log, p.master, r) for p, r in zip(new, routes, strict=True)]
        apply_plan(moved, step + 1, layers, rounds)
        moved.call_all("commit", step + 1)
        current = list(new)
        # every copy equals its master's weights after the move
        for layer, p in enumerate(current):
            for e in range(6):
                m = int(p.master_rank()[e])
                ref = moved.ranks[m].experts[layer][e]
                for rs in moved.ranks:
                    if e in rs.experts[layer]:
                        for a, b in zip(rs.experts[layer][e], ref, strict=True):
                            assert torch.equal(a, b)
    np.testing.assert_allclose(losses_b, losses_a, rtol=1e-5)
    assert losses_a[-1] < losses_a[0]


def test_workers_refuse_stale_plans_and_unprepared_commits() -> None:
    topo = _topology()
    static = static_placement(topo.num_ranks, topo.slots_per_rank, 6, topo.masters_per_rank)
    ex = LocalExecutor(_ranks(topo, static, np.zeros((0, 4), np.int64)))
    layers = [(static.phy2log, static.master, np.zeros((0, 4), np.int64))] * CFG.num_layers
    with pytest.raises(ValueError, match="not prepared"):
        ex.call_all("commit", 3)
    apply_plan(ex, 3, layers, [])
    ex.call_all("commit", 3)
    ex.call_all("commit", 3)  # idempotent
    with pytest.raises(ValueError, match="not newer"):
        ex.call_all("prepare", 2, layers)


def test_assign_destinations_follows_route_shares_and_holders() -> None:
    rank_dc = np.array([0, 0, 1, 1])
    holds = np.zeros((4, 3), bool)
    holds[[0, 2], 0] = True
    holds[[1, 3], 1] = True
    holds[2, 2] = True
    idx = np.array([[0, 1]] * 10 + [[2, 0]] * 2)
    route = np.array([[0, 0, 0, 3], [0, 0, 2, 1]])  # 3:1 between ranks 0 and 2
    dst = assign_destinations(0, idx, route, holds, rank_dc)
    assert holds[dst, idx].all()
    zero = dst[idx == 0]
    assert (zero == 0).sum() == 9 and (zero == 2).sum() == 3
    assert set(dst[idx == 1].tolist()) == {1}  # unseen by the route: own DC's copy
    bad = np.array([[0, 0, 1, 5]])
    with pytest.raises(ValueError, match="does not hold"):
        assign_destinations(0, idx, bad, holds, rank_dc)


@given(
    total=st.integers(0, 1000),
    weights=st.lists(st.integers(0, 50), min_size=1, max_size=8).filter(lambda w: sum(w) > 0),
)
def test_largest_remainder_sums_and_stays_close(total: int, weights: list[int]) -> None:
    out = largest_remainder(total, np.array(weights, float))
    assert out.sum() == total
    exact = total * np.array(weights) / sum(weights)
    assert (np.abs(out - exact) < 1).all()


def test_packets_travel_as_numpy_and_come_back_as_writable_tensors() -> None:
    y = torch.arange(12.0).reshape(6, 2)
    pkt = {"v": 1, "x": y[1:3], "ew": {(0, 2): [torch.ones(2, requires_grad=True)]}, "t": (y[0],)}
    wire = to_wire(pkt)
    assert isinstance(wire["x"], np.ndarray) and wire["x"].shape == (2, 2)
    frozen = wire["x"].copy()
    frozen.setflags(write=False)  # as Ray hands out arrays it deserialized in place
    back = from_wire({**wire, "x": frozen})
    assert isinstance(back["x"], torch.Tensor) and back["x"].tolist() == [[2.0, 3.0], [4.0, 5.0]]
    back["x"] += 1  # writable (a copy of the read-only array)
    assert isinstance(back["ew"][(0, 2)][0], torch.Tensor) and isinstance(back["t"], tuple)
    assert back["v"] == 1


def test_stats_report_what_was_dispatched_and_crossed() -> None:
    topo = _topology()
    placement, route = random_plan(np.random.default_rng(7), topo, CFG.num_experts)
    ranks = _ranks(topo, placement, route)
    stats = train_step(LocalExecutor(ranks), 0, CFG.num_layers)
    holds = placement.holds()
    for layer in range(CFG.num_layers):
        routed = np.concatenate([s["routed"][layer] for s in stats])  # [N, 4]
        assert holds[routed[:, 2], routed[:, 1]].all()
        got = np.bincount(routed[:, 2], weights=routed[:, 3], minlength=topo.num_ranks)
        assert got.tolist() == [s["computed"][layer] for s in stats]
        for s in stats:
            mine = routed[routed[:, 0] == s["rank"]]
            assert mine[:, 3].sum() == CFG.tokens_per_rank * CFG.top_k
            cross = s["crossings"][layer]
            dc = topo.rank_dc[s["rank"]]
            assert cross[dc] == 0
            for b in range(topo.num_dcs):
                if b == dc:
                    continue
                a = mine[topo.rank_dc[mine[:, 2]] == b, 3].sum()
                assert (a > 0) == (cross[b] > 0)
                assert a / CFG.top_k <= cross[b] <= min(a, CFG.tokens_per_rank)
            assert s["expert_seconds"][layer] > 0 or s["computed"][layer] == 0


def _closed_plan(topo: Topology) -> Placement:
    """Every DC holds every expert (3 DCs x 2 ranks x 4 slots, 6 experts, masters static)."""
    static = static_placement(topo.num_ranks, topo.slots_per_rank, 6, topo.masters_per_rank)
    phy2log = static.phy2log.copy()
    for r in range(topo.num_ranks):
        other = r + 1 if r % 2 == 0 else r - 1  # the other rank of its DC
        need = [e for e in range(6) if e not in phy2log[r] and e not in phy2log[other]]
        for e in need[: 3 if r % 2 == 0 else None]:
            phy2log[r, np.flatnonzero(phy2log[r] < 0)[0]] = e
    return Placement(phy2log, static.master)


def _run_layout(placement: Placement, route: np.ndarray, layout: StepLayout | None) -> tuple:
    topo = _topology()
    ranks = _ranks(topo, placement, route)
    losses = [
        [s["loss"] for s in train_step(LocalExecutor(ranks), step, CFG.num_layers, layout)]
        for step in range(2)
    ]
    weights = [
        t.detach().clone() for rs in ranks for m in rs.experts for w in m.values() for t in w
    ]
    return losses, weights, [rs.bytes.copy() for rs in ranks]


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(["closed", "static", "random"]))
def test_rounds_a_plan_does_not_need_are_skipped_bit_for_bit(seed: int, kind: str) -> None:
    topo = _topology()
    route = np.zeros((0, 4), np.int64)
    if kind == "closed":  # no relay, no fan-out
        placement = _closed_plan(topo)
    elif kind == "static":  # relays, no fan-out
        placement = static_placement(topo.num_ranks, topo.slots_per_rank, 6, 1)
    else:
        placement, route = random_plan(np.random.default_rng(seed), topo, CFG.num_experts)
    layout = step_layout([placement] * CFG.num_layers, [route] * CFG.num_layers, topo)
    want = {"closed": (False, False), "static": (True, False)}.get(kind)
    assert want is None or (layout.relay[0], layout.fanout) == want
    full = _run_layout(placement, route, None)
    fewer = _run_layout(placement, route, layout)
    assert full[0] == fewer[0]
    assert all(torch.equal(a, b) for a, b in zip(full[1], fewer[1], strict=True))
    assert all((a == b).all() for a, b in zip(full[2], fewer[2], strict=True))
    rounds = step_phases(layout)
    assert len(rounds) + 1 == layout.rounds <= StepLayout.full(CFG.num_layers).rounds


def test_a_layout_that_skips_a_needed_relay_fails() -> None:
    topo = _topology()
    static = static_placement(topo.num_ranks, topo.slots_per_rank, 6, topo.masters_per_rank)
    ranks = _ranks(topo, static, np.zeros((0, 4), np.int64))
    with pytest.raises(ValueError, match="skips its round"):
        train_step(LocalExecutor(ranks), 0, CFG.num_layers, StepLayout((False, True), False))
