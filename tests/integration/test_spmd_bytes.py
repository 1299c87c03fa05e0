"""The SPMD plane's bytes between DCs are the cost model's, exactly, per encoding.

Real gloo processes (no Ray), 3 DCs x 2 ranks, every DC holding every expert (what
``hybrid`` converges to here): one training step's expert sync sends, per DC pair, what
``planner.costmodel.replica_streams`` predicts (weights out to each remote DC once per
expert, gradients back), in float32 and in bfloat16; the dense gradients cross between
the DC leaders at float32. Checked per collective too (``Comm.crossed``, what the runtime
writes into its trace for ``expertmesh sim replay``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from expertmesh.planner import Placement, Topology
from expertmesh.planner.costmodel import TransferEncoding, replica_streams
from expertmesh.planner.plan import Migration
from expertmesh.planner.rounds import migration_rounds
from expertmesh.planner.static import static_placement
from expertmesh.workers.model import Corpus, LMConfig
from tests.integration.spmd_procs import run_ranks

pytestmark = pytest.mark.integration

CFG = LMConfig(
    num_layers=2, num_experts=6, top_k=2, hidden=8, ffn_hidden=8, seq_len=8, batch=2, seed=3
)
CORPUS = Corpus(bytes(range(256)) * 8 + b"the quick brown fox jumps over the lazy dog " * 40)
TOPO = Topology.generate(3, 2, masters=1, spare=3)  # 3 DCs x 2 ranks, 4 slots each
BF16 = TransferEncoding(weight_bytes=2, grad_bytes=2)
WEIGHTS = 1  # workers/comm.py KINDS: tokens, weights, migration


def _replicated() -> Placement:
    """Static's masters (expert e on rank e), and a copy of every expert in every DC."""
    static = static_placement(
        TOPO.num_ranks, TOPO.slots_per_rank, CFG.num_experts, TOPO.masters_per_rank
    )
    phy2log = static.phy2log.copy()
    for d in range(TOPO.num_dcs):
        ranks = np.flatnonzero(TOPO.rank_dc == d).tolist()
        for e in range(CFG.num_experts):
            if (phy2log[ranks] == e).any():
                continue
            r = min(ranks, key=lambda q: int((phy2log[q] >= 0).sum()))
            phy2log[r, int(np.flatnonzero(phy2log[r] < 0)[0])] = e
    return Placement(phy2log, static.master)


def _step_bytes(comm: Any, encoding: dict[str, Any] | None) -> dict[str, Any]:
    """Step 0 on static, switch to the replicated plan (boundary), step 1: what step 1
    sent between DCs (this rank's [3, D, D] and its crossing collectives)."""
    from expertmesh.workers.spmd import SpmdRank
    from expertmesh.workers.wire import WireFormat

    static = static_placement(
        TOPO.num_ranks, TOPO.slots_per_rank, CFG.num_experts, TOPO.masters_per_rank
    )
    rank = SpmdRank(comm, CFG, CORPUS, [static] * CFG.num_layers)
    rank.train_step(0)
    new = [_replicated()] * CFG.num_layers
    rounds = migration_rounds([static] * CFG.num_layers, new, [Migration()] * CFG.num_layers, TOPO)
    no_route = np.zeros((0, 4), np.int64)  # every token to the copies in its own DC
    wire = WireFormat.of(TransferEncoding(**encoding) if encoding else None)
    rank.apply_plan(1, [(p.phy2log, p.master, no_route) for p in new], rounds, wire)
    comm.take_crossed()  # the migration's
    before = comm.bytes.copy()
    stats = rank.train_step(1)
    dense = sum(p.numel() for p in rank.dense.parameters())
    return {
        "bytes": (comm.bytes - before).tolist(),
        "crossed": stats["crossed"],
        "flat": dense + CFG.num_layers * CFG.num_experts + 1,  # + counts + the offer word
        "leader": comm.rank == comm.leader,
    }


@pytest.mark.parametrize("encoding", [None, BF16], ids=["float32", "bfloat16"])
def test_cross_dc_bytes_of_a_step_are_the_cost_models(encoding: TransferEncoding | None) -> None:
    enc = None if encoding is None else encoding.model_dump()
    res = run_ranks(_step_bytes, TOPO.rank_dc, enc)
    d = TOPO.num_dcs
    got = np.sum([np.asarray(r["bytes"]) for r in res], axis=0)  # [3, D, D]
    assert got[0].sum() == 0  # every token stays in its DC
    assert got[2].sum() == 0  # no migration in the step
    # the cost model: per layer, one crossing per (expert, remote DC) each way
    streams = replica_streams(_replicated(), TOPO, CFG.spec(), None, encoding)
    grads, weights = np.zeros((d, d)), np.zeros((d, d))
    np.add.at(grads, (streams.pair_src, streams.pair_dst), streams.pair_tail)
    np.add.at(weights, (streams.pair_src, streams.pair_dst), streams.pair_background)
    grads, weights = grads * CFG.num_layers, weights * CFG.num_layers
    per = CFG.spec().expert_params * (4 if encoding is None else 2)
    assert weights.sum() == CFG.num_experts * (d - 1) * CFG.num_layers * per  # one per remote DC
    # the dense gradients (and the counts riding along): every DC leader to every other
    flat = res[0]["flat"] * 4
    dense = np.full((d, d), float(flat)) - np.diag([float(flat)] * d)
    np.testing.assert_array_equal(got[WEIGHTS], grads + weights + dense)
    # per collective, summed over the ranks as the controller sums them: the leaders'
    # dense sum, then the expert sync's two WAN hops (gradients in, fresh weights out)
    by: dict[tuple[str, int], np.ndarray] = {}
    for r, out in enumerate(res):
        for group, n, kind, to_dc in out["crossed"]:
            assert kind == WEIGHTS
            m = by.setdefault((group, n), np.zeros((d, d)))
            m[TOPO.rank_dc[r]] += to_dc
    leaders = [m for (g, _), m in sorted(by.items()) if g == "leaders"]
    world = [m for (g, _), m in sorted(by.items()) if g == "world"]
    assert len(leaders) == 1 and len(world) == 2 and len(by) == 3
    np.testing.assert_array_equal(leaders[0], dense)
    np.testing.assert_array_equal(world[0], grads)
    np.testing.assert_array_equal(world[1], weights)
