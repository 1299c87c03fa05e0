"""Recovery in the data plane without Ray: a step undone and run again, ranks planned out
(dead), masters restored from replicas or a checkpoint (expertmesh.workers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from expertmesh.planner import Topology
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.policy import PolicyContext, make_policy
from expertmesh.planner.runner import plan_layer
from expertmesh.planner.static import static_placement
from expertmesh.runtime.checkpoint import CheckpointDir
from expertmesh.workers.engine import LocalExecutor, recovery_rounds, train_step
from expertmesh.workers.model import Corpus, LMConfig
from expertmesh.workers.rank import RankState

CFG = LMConfig(
    num_layers=2, num_experts=6, top_k=2, hidden=8, ffn_hidden=8, seq_len=8, batch=2, seed=3
)
CORPUS = Corpus(bytes(range(256)) * 8 + b"the quick brown fox jumps over the lazy dog " * 40)
TOPO = Topology.generate(3, 2, masters=1, spare=3)  # 3 DCs x 2 ranks, 4 slots each
E = CFG.num_experts


def _ranks() -> list[RankState]:
    p = static_placement(TOPO.num_ranks, TOPO.slots_per_rank, E, TOPO.masters_per_rank)
    return [RankState(r, TOPO, CFG, CORPUS, [p] * CFG.num_layers) for r in range(TOPO.num_ranks)]


def _weights(ranks: list[RankState]) -> list[dict]:
    out = []
    for rs in ranks:
        out.append({(lyr, e): [t.detach().clone() for t in w]
                    for lyr, mine in enumerate(rs.experts) for e, w in mine.items()})  # fmt: skip
        out[-1]["dense"] = [t.detach().clone() for t in rs.dense.parameters()]
    return out


def _equal(a: list[dict], b: list[dict]) -> bool:
    return all(
        ka == kb and all(torch.equal(x, y) for k in ka for x, y in zip(da[k], db[k], strict=True))
        for da, db in zip(a, b, strict=True)
        for ka, kb in [(sorted(da, key=str), sorted(db, key=str))]
    )


def test_rollback_undoes_a_step_and_the_rerun_matches() -> None:
    ex = LocalExecutor(_ranks())
    train_step(ex, 0, CFG.num_layers)
    before = _weights(ex.ranks)
    first = [s["loss"] for s in train_step(ex, 1, CFG.num_layers)]
    after = _weights(ex.ranks)
    assert not _equal(before, after)
    assert set(ex.call_all("rollback_step")) == {0}
    assert _equal(before, _weights(ex.ranks))
    again = [s["loss"] for s in train_step(ex, 1, CFG.num_layers)]
    assert again == first
    assert _equal(after, _weights(ex.ranks))  # bit for bit the same step


@pytest.mark.parametrize("dead", [(1,), (2, 3)])  # one rank; a whole DC
def test_survivors_train_after_masters_restored(dead: tuple[int, ...], tmp_path: Path) -> None:
    ex = LocalExecutor(_ranks())
    train_step(ex, 0, CFG.num_layers)
    masters: dict = {}
    for part in ex.call_all("checkpoint"):
        masters.update(part)
    disk = CheckpointDir(tmp_path)  # through the checkpoint on disk, as the runtime does
    disk.write(masters, step=0, plan_version=0, run="t")
    ckpt = disk.load_latest(run="t").experts
    train_step(ex, 1, CFG.num_layers)  # dies during step 1 on the dead ranks: undo it
    ex.call_all("rollback_step")
    live = np.ones(TOPO.num_ranks, bool)
    live[list(dead)] = False
    ex.live = live
    ex.call_all("set_live", live.tolist())
    old = [rs.layers[lyr].placement for lyr, rs in [(i, ex.ranks[0]) for i in range(2)]]
    model = ModelSpec(num_layers=CFG.num_layers, num_experts=E, hidden=8, ffn_hidden=8)
    load = np.ones((TOPO.num_ranks, E), np.int64)
    new_plans = [
        plan_layer(
            make_policy("eplb"),
            PolicyContext(
                topology=TOPO,
                model=model,
                step=1,
                layer=lyr,
                load=load,
                history=load[None],
                dead_ranks=dead,
            ),
        )
        for lyr in range(CFG.num_layers)
    ]
    new = [lp.placement for lp in new_plans]
    rounds, restore = recovery_rounds(old, new, live, TOPO)
    lost = {(lyr, e) for lyr, p in enumerate(old) for e in range(E) if not live[p.master_rank()[e]]}
    assert lost and {(lyr, e) for lyr, e, _, kind in restore if kind == "opt"} == lost
    for _, _, src, dst, _ in [t for rnd in rounds for t in rnd]:
        assert live[src] and live[dst]
    layers = [(p.phy2log, p.master, lp.route) for p, lp in zip(new, new_plans, strict=True)]
    ex.call_all("prepare", 1, layers)
    for lyr, e, r, kind in restore:
        w, m, v = ckpt[(lyr, e)]
        ex.ranks[r].seed(*(({(lyr, e): w}, {}) if kind == "w" else ({}, {(lyr, e): (m, v)})))
    outs = None
    for rnd in [*rounds, []]:
        outs = ex.phase("mig", 0, outs, rnd)
    ex.call_all("prepare_end", 1)
    ex.call_all("commit", 1)
    for lyr, e, r, kind in restore:  # what the checkpoint on disk held, bit for bit
        if kind == "w":
            got = ex.ranks[r].expert_weights(lyr, e)
            assert got is not None
            assert all(np.array_equal(a, b) for a, b in zip(got, ckpt[(lyr, e)][0], strict=True))
    losses = [s["loss"] for s in train_step(ex, 1, CFG.num_layers)]
    assert len(losses) == int(live.sum()) and all(np.isfinite(losses))
    masters = [k for r in np.flatnonzero(live) for k in ex.ranks[r].checkpoint()]
    assert sorted(masters) == sorted((lyr, e) for lyr in range(CFG.num_layers) for e in range(E))
    stats = train_step(ex, 2, CFG.num_layers)  # and on
    assert all(s["computed"].sum() > 0 for s in stats)


def test_recovery_rounds_refuse_copies_on_dead_ranks() -> None:
    p = static_placement(TOPO.num_ranks, TOPO.slots_per_rank, E, TOPO.masters_per_rank)
    live = np.ones(TOPO.num_ranks, bool)
    live[0] = False
    with pytest.raises(ValueError, match="dead ranks"):
        recovery_rounds([p], [p], live, TOPO)


def test_set_live_refuses_bad_masks() -> None:
    rs = _ranks()[0]
    with pytest.raises(ValueError, match="live"):
        rs.set_live([False] + [True] * (TOPO.num_ranks - 1))
    with pytest.raises(ValueError, match="live"):
        rs.set_live([True])
