"""The simulator's memos (sim/engine.py ``_Memo``, traffic.py's per-load memo) give what the
functions they stand in for give, for every argument that can differ between two calls."""

from __future__ import annotations

import numpy as np
import pytest

from expertmesh.planner.costmodel import CostSettings, TransferEncoding, replica_streams
from expertmesh.planner.migration import align_placement, plan_migration
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import LayerPlan, TransferKind
from expertmesh.planner.policy import PolicyContext, make_policy
from expertmesh.planner.topology import Topology
from expertmesh.planner.traffic import even_traffic
from expertmesh.sim.engine import (
    _aligned,
    _context,
    _History,
    _migration,
    _PolicyState,
    _sync_streams,
    _World,
)

TOPO = Topology.generate(4, 4, nodes_per_dc=2, masters=2, spare=2)
MODEL = ModelSpec(num_experts=32, top_k=2, num_layers=1)


def _placements(seed: int = 0) -> tuple[np.ndarray, list]:
    """A load and a few different placements of it (static, eplb, quota)."""
    rng = np.random.default_rng(seed)
    load = rng.integers(0, 50, (TOPO.num_ranks, MODEL.num_experts)) * (
        1 + 9 * (rng.random(MODEL.num_experts) < 0.2)
    )
    out = []
    for name in ("static", "eplb", "quota"):
        ctx = PolicyContext(
            topology=TOPO, model=MODEL, step=0, layer=0, load=load,
            history=load[None], previous=None,
        )  # fmt: skip
        out.append(make_policy(name, None).place(ctx))
    return load, out


def _same_traffic(a, b) -> None:
    for f in ("rank_tokens", "rank_out", "rank_in", "pair_src", "pair_dst", "pair_tokens",
              "dc_tokens"):  # fmt: skip
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


def test_even_traffic_of_a_read_only_load_is_that_of_a_writable_one():
    load, placements = _placements()
    frozen = load.copy()
    frozen.flags.writeable = False  # memoized: every call below after the first may hit
    for _ in range(2):
        for p in placements:
            for domain in ("rank", "node", "dc", "global"):
                for remote in ("spread", "master"):
                    got = even_traffic(frozen, p, TOPO, 2, domain=domain, remote=remote)
                    want = even_traffic(load, p, TOPO, 2, domain=domain, remote=remote)
                    _same_traffic(got, want)
    # another top-k: other token counts per DC
    _same_traffic(
        even_traffic(frozen, placements[0], TOPO, 4), even_traffic(load, placements[0], TOPO, 4)
    )
    # memoized results cannot be changed by a caller
    t = even_traffic(frozen, placements[1], TOPO, 2)
    assert not t.rank_tokens.flags.writeable and not t.dc_tokens.flags.writeable


def test_engine_memo_aligns_and_migrates_as_the_planner_does():
    _, ps = _placements(1)
    _, qs = _placements(2)
    world = _World(TOPO, MODEL, CostSettings(), {}, (TOPO.num_ranks, MODEL.num_experts))
    pairs = [(ps[0], ps[1]), (ps[2], ps[1]), (ps[0], qs[2]), (ps[0], ps[1]), (qs[1], ps[2])]
    for old, new in pairs:
        for relabel in (False, True, False):
            got = _aligned(world, old, new, relabel)
            want = align_placement(old, new, TOPO, relabel)
            assert np.array_equal(got.phy2log, want.phy2log)
            assert np.array_equal(got.master, want.master)
    for old in (ps[0], ps[2], qs[0], ps[0]):  # one new placement from several old ones
        got = _migration(world, old, ps[1])  # the memo's transfers, as arrays
        want = plan_migration(old, ps[1], TOPO, MODEL).transfers  # the planner's, in order
        assert got.src.tolist() == [t.src_rank for t in want]
        assert got.dst.tolist() == [t.dst_rank for t in want]
        assert got.expert.tolist() == [t.expert for t in want]
        assert got.master.tolist() == [t.kind == TransferKind.MASTER for t in want]
    assert world.memo.hits > 0


def test_engine_memo_keeps_each_encodings_replica_streams():
    _, ps = _placements(3)
    world = _World(TOPO, MODEL, CostSettings(), {}, (TOPO.num_ranks, MODEL.num_experts))
    plain = _PolicyState("a", make_policy("static", None), 1)
    lean = _PolicyState("b", make_policy("static", None), 1)
    lean.encoding = TransferEncoding(weight_bytes=1.0, grad_bytes=1.0)
    for st in (plain, lean, plain, lean):
        for p in ps:
            got = _sync_streams(st, world, 0, p)
            want = replica_streams(p, TOPO, MODEL, world.cost, st.encoding)
            for f in ("pair_src", "pair_dst", "pair_tail", "pair_background", "port_tail",
                      "port_background"):  # fmt: skip
                assert np.array_equal(getattr(got, f), getattr(want, f)), f


def test_each_window_gets_its_own_history_and_the_checked_load():
    # a step's contexts are checked once per layer: another window's context is a copy
    # with its own history (_context), the policy's previous plan in a copy of that
    load, ps = _placements(4)
    world = _World(TOPO, MODEL, CostSettings(), {}, (TOPO.num_ranks, MODEL.num_experts))
    for w in (0, 3):
        world.hist[(w, 0)] = _History(w)
    for t in range(5):
        step = load + t
        step.flags.writeable = False
        c0 = _context(world, t, (0, 0), step, None)
        prev = LayerPlan(placement=ps[0], route=np.zeros((0, 4), np.int64))
        c3 = _context(world, t, (3, 0), step, prev)
        assert c0.load is c3.load and c0.history.shape[0] == 0 and c0.previous is None
        assert c3.previous is prev and c3.step == t
        assert [int(h[0, 0]) for h in c3.history] == [
            int(load[0, 0]) + s for s in range(max(0, t - 3), t)
        ]
        for h in world.hist.values():
            h.push(step)
        world.contexts.clear()
    with pytest.raises(ValueError, match="negative"):
        _context(world, 5, (3, 0), load - 10**6, None)  # the first context of a step checks
