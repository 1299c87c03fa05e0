"""The SPMD runtime writes what it trained on (runtime/trace.py): at every checkpoint and
at the end, trace.npz (the load every rank reported, per step) and plans.npz (the plan
every step ran on), which `expertmesh sim replay` reads. Real local Ray, real gloo."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from expertmesh.cli.main import main
from expertmesh.controller.core import Trigger
from expertmesh.formats import read_plan, read_trace
from expertmesh.planner import Topology
from expertmesh.runtime.settings import RuntimeSettings, StepResult
from expertmesh.runtime.spmd import SpmdRuntime
from expertmesh.sim.replay import Calibration, RuntimeMeta, replay
from expertmesh.workers.model import Corpus, LMConfig
from expertmesh.workers.reference import ReferenceLM

pytestmark = pytest.mark.integration

LM = LMConfig(num_layers=2, num_experts=8, top_k=2, hidden=16, ffn_hidden=16, batch=4, seq_len=32)
STEPS = 7
# the plan each step runs on: hybrid's plans are made after steps 0, 3 and 6; the first
# step of a chunk is the first that can see an offer, the driver waits for offers to land
# before a chunk (so with a chunk per step this does not depend on how fast Ray delivers
# them); boundary switches after the step that agreed (steps 1, 4), background in the sync
# of the step after it (steps 2, 5); the plan made after the last step is never switched to,
# so the last step runs on the final plan
VERSIONS = {"boundary": [0, 0, 1, 1, 1, 2, 2], "background": [0, 0, 0, 1, 1, 1, 2]}


def _reference_counts(ranks: int) -> np.ndarray:
    """[L, R, E] the gate's counts of step 0 (initial weights) on every rank's batch, from
    the single-process reference model (which the SPMD plane equals)."""
    ref, corpus = ReferenceLM(LM), Corpus.load(None, 200_000)
    out = np.zeros((LM.num_layers, ranks, LM.num_experts), np.int64)
    with torch.no_grad():
        for r in range(ranks):
            x, _ = corpus.batch(LM, 0, r)
            h = ref.dense.embed(x)
            for layer in range(LM.num_layers):
                a, u = ref.dense.mix(layer, h)
                u = u.reshape(-1, u.shape[-1])
                idx = (u @ ref.dense.gates[layer].weight.T).topk(LM.top_k, dim=-1).indices
                out[layer, r] = np.bincount(idx.reshape(-1).numpy(), minlength=LM.num_experts)
                h = a + ref.moe(layer, u).reshape(a.shape)
    return out


@pytest.mark.parametrize("migration", ["background", "boundary"])
def test_the_runtime_writes_its_trace_and_plans_and_replay_reads_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], migration: str
) -> None:
    """``background`` (the runtime's default): a switch's moved masters travel during the
    switch step, whose sync switches; ``boundary``: the migration rounds run after it."""
    topo = Topology.generate(2, 2, masters=2, spare=2).with_inter_dc(0.5, 2.0)
    settings = RuntimeSettings(
        topology=topo.to_dict(), lm=LM, policy="hybrid", trigger=Trigger(mode="every_n", every=3),
        balance=False, corpus_bytes=200_000, trace_dir=str(tmp_path), migration=migration,
        load_reports="rank",  # a complete load every step
        checkpoint_every=1,  # a chunk per step (VERSIONS)
    )  # fmt: skip
    at_checkpoint: list[int] = []

    def seen(r: StepResult) -> None:
        if r.step == 3:  # the checkpoint after step 2 wrote 3 steps
            at_checkpoint.append(read_trace(tmp_path / "trace.npz").load.shape[0])

    with SpmdRuntime(settings) as rt:
        steps = rt.train(STEPS, on_step=seen)
        final = rt.committed_plan()
    assert at_checkpoint == [3]
    trace, plan = read_trace(tmp_path / "trace.npz"), read_plan(tmp_path / "plans.npz")
    meta = RuntimeMeta(**trace.meta)
    assert trace.load.shape == (STEPS, 2, 4, 8)
    # every rank's gate counts: each of its tokens goes to top_k experts
    np.testing.assert_array_equal(trace.load.sum(axis=3), LM.tokens_per_rank * LM.top_k)
    assert meta.step_seconds == [s.seconds for s in steps]
    assert meta.plan_versions == [s.plan_version for s in steps]
    assert meta.bytes_by_pair == [s.bytes_by_pair for s in steps]
    assert meta.topology == topo.to_dict() and meta.policy == "hybrid" and not meta.balance
    versions = meta.plan_versions
    assert versions == VERSIONS[migration]  # static first, then hybrid's plans
    np.testing.assert_array_equal(trace.load[0], _reference_counts(topo.num_ranks))
    # under static every rank computes what the gate sent to its masters (rank r holds
    # experts 2r and 2r + 1): the load as the controller saw it, rank by rank
    for t in (i for i, v in enumerate(versions) if v == 0):
        for layer in range(2):
            by_master = trace.load[t, layer].sum(axis=0).reshape(4, 2).sum(axis=1)
            assert by_master.tolist() == steps[t].tokens_per_layer_rank[layer]
    assert final is not None
    last = versions[-1]
    for layer, (phy2log, master, route) in enumerate(final):
        np.testing.assert_array_equal(plan.phy2log[-1, layer], phy2log)
        np.testing.assert_array_equal(plan.master[-1, layer], master)
        rows = plan.route[(plan.route[:, 0] == STEPS - 1) & (plan.route[:, 1] == layer)]
        np.testing.assert_array_equal(rows[:, 2:], np.asarray(route).reshape(-1, 4))
    switched = {b for a, b in itertools.pairwise(versions) if a != b}
    assert switched and switched <= {int(v) for v in plan.meta["migration_collectives"]}
    assert str(last) in plan.meta["migration_collectives"]

    cal = tmp_path / "cal.yaml"
    cal.write_text(
        yaml.safe_dump({"seconds_per_token": 1e-5, "collective_seconds": 1e-3, "ranks": 4})
    )
    args = ["sim", "replay", "--trace", str(tmp_path / "trace.npz"), "--plan",
            str(tmp_path / "plans.npz"), "--calibration", str(cal)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "hybrid: predicted median step" in out and "measured" in out
    # the step model's collectives are the ones the workers issued, step by step (a plan
    # switch's transfers start after the step's report: the workers count them in the
    # next; background, that is the switch step, boundary, the step after it)
    mig = {int(v): c for v, c in plan.meta["migration_collectives"].items()}
    res = replay(trace.load, meta, plan.phy2log, plan.master, plan.route, migration=mig,
                 calibration=Calibration(seconds_per_token=0, collective_seconds=0))  # fmt: skip
    model = res.counts["collectives"].copy()
    if migration == "boundary":
        assert res.counts["migration"].sum() > 0
        model -= res.counts["migration"]
        model[1:] += res.counts["migration"][:-1]
    assert meta.model_extra is not None
    assert model[1:].tolist() == meta.model_extra["collectives"][1:]
    # the bytes of every collective that crossed add up to the step's bytes per kind and
    # DC pair, and the replay's transfer is their busiest pairs summed
    assert len(meta.collective_bytes) == STEPS
    for t, colls in enumerate(meta.collective_bytes):
        per_kind = np.zeros((3, 2, 2), np.int64)
        for kind, m in colls:
            per_kind[kind] += np.asarray(m)
        np.testing.assert_array_equal(per_kind, meta.bytes_by_pair[t])
    assert all(colls for colls in meta.collective_bytes)  # static's tokens cross every step
    moved = sum(np.asarray(m).sum() for colls in meta.collective_bytes for k, m in colls if k == 2)
    assert moved > 0  # hybrid's plans moved masters or copies between DCs
