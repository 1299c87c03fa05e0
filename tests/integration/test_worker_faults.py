"""A worker actor killed mid-training (issue 7): the driver notices, the survivors undo
the step, the controller replans without the dead rank and restores its masters (from a
replica, else from the newest checkpoint on disk), the step runs again; then a new worker
takes the rank's place in its DC and rejoins. A truncated checkpoint is refused and the
previous one used."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch

from expertmesh.runtime.checkpoint import CheckpointDir
from expertmesh.runtime.cluster import NAMESPACE, Runtime, weights_digest

STEPS = 9  # then one more kill with replacement off (step 9)
RUNTIME_OVERRIDES = {"checkpoint_keep": 10}  # the checkpoints recovery used stay to be read


def _kill(rank: int) -> None:
    ray.kill(ray.get_actor(f"worker-{rank}", namespace=NAMESPACE), no_restart=True)


def _replicated_master(plan: list[Any], dead: set[int]) -> tuple[int, int, int, int]:
    """(layer, expert, master rank, replica rank) of an expert with a replica elsewhere."""
    for layer, (phy2log, master, _) in enumerate(plan):
        slots = phy2log.shape[1]
        for e in range(master.shape[0]):
            m = int(master[e]) // slots
            others = [r for r in np.flatnonzero((phy2log == e).any(axis=1)) if r != m]
            if m not in dead and others:
                return layer, e, m, int(others[0])
    raise AssertionError("eplb made no replica")


def _masters(rt: Runtime) -> list[tuple[int, int]]:
    """(layer, expert) of every master state held by a live worker (with repeats)."""
    parts = ray.get([rt.workers[r].call.remote("checkpoint") for r in np.flatnonzero(rt.live)])
    return [k for part in parts for k in part]


def _checkpoint_digests(rt: Runtime, name: str) -> dict[str, str]:
    """sha256 of every expert's weights in checkpoint ``name`` of the run, read from disk."""
    assert rt.checkpoints is not None
    ck = CheckpointDir(rt.checkpoints.root).load(Path(rt.checkpoints.root) / name)
    return {f"{layer}/{e}": weights_digest(w) for (layer, e), (w, _, _) in ck.experts.items()}


@pytest.fixture(scope="module")
def worker_kills(fault_runtime: Runtime) -> Iterator[dict[str, Any]]:
    rt = fault_runtime
    out: dict[str, Any] = {"steps": [], "kill_steps": [], "lm": rt.settings.lm}
    for _ in range(3):
        out["steps"].append(rt.run_step())
    # 1) ray.kill between steps of a master whose expert has a replica on another rank:
    # the next step fails, the survivors undo it, the master comes back from the replica
    layer, e, m, h = _replicated_master(rt.committed_plan() or [], set())
    out["replica"] = (f"{layer}/{e}", weights_digest(rt.expert_weights(h, layer, e) or []))
    _kill(m)
    out["kill_steps"].append(rt.step + 1)
    out["steps"].append(rt.run_step())
    out["live_after_first"] = rt.live.copy()  # replaced at the end of the retried step
    for _ in range(2):
        out["steps"].append(rt.run_step())
    # 2) the newest checkpoint on disk is truncated; a worker of the other DC dies in the
    # middle of a step, after the survivors began updating weights (red3 runs Adam)
    assert rt.checkpoints is not None
    newest = rt.checkpoints.paths()[0]
    data = newest / "experts.npz"
    data.write_bytes(data.read_bytes()[:1000])
    out["truncated"] = newest.name
    second = next(r for r in range(rt.topology.num_ranks)
                  if r != m and rt.topology.rank_dc[r] != rt.topology.rank_dc[m])  # fmt: skip
    out["kill_steps"].append(rt.step + 1)
    rt.inject_worker_exit(second, rt.step + 1, "red3")
    while rt.step + 1 < STEPS:
        out["steps"].append(rt.run_step())
    out["dead"] = (m, second)
    out["retried"] = list(rt.retried_steps)
    out["recoveries"] = list(rt.recoveries)
    out["ckpt_digests"] = {
        r["checkpoint"]: _checkpoint_digests(rt, r["checkpoint"])
        for r in rt.recoveries
        if r["reason"] == "step failed"
    }
    out["status"] = rt.status()
    out["plan"] = rt.committed_plan()
    out["live"] = rt.live.copy()
    out["masters"] = _masters(rt)
    out["dense"] = [ray.get(w.call.remote("export_dense"))["dense"] for w in rt.workers]
    out["nodes"] = rt.node_dcs()
    out["rank_dcs"] = [rt.topology.dcs[int(d)].name for d in rt.topology.rank_dc]
    report = os.environ.get("EXPERTMESH_FAULTS_REPORT")
    if report:  # the figures of docs/reliability.md
        Path(report).write_text(json.dumps({k: out["status"][k] for k in (
            "retried_steps", "recoveries", "replacements", "checkpoints")}, indent=1))  # fmt: skip
    # 3) replacement off: a dead rank stays out
    rt.settings = rt.settings.model_copy(update={"replace_dead_workers": False})
    _kill(m)
    out["no_replace"] = (m, rt.run_step(), rt.live.copy(), rt.status(), _masters(rt))
    yield out


def test_training_finishes_with_no_step_dropped(worker_kills: dict[str, Any]) -> None:
    steps = worker_kills["steps"]
    assert [s.step for s in steps] == list(range(STEPS))
    assert all(math.isfinite(s.loss) for s in steps)
    assert all(s.error is None for s in steps)
    # each kill made a step fail; it was retried (listed), not dropped
    retried = worker_kills["retried"]
    assert retried == worker_kills["kill_steps"]
    status = worker_kills["status"]  # what the demo's summary JSON lists
    assert status["retried_steps"] == retried
    assert status["dead_ranks"] == []  # both were replaced


def test_dead_ranks_are_replaced_and_train_again(worker_kills: dict[str, Any]) -> None:
    m, second = worker_kills["dead"]
    retried = worker_kills["retried"]
    assert worker_kills["live_after_first"].all()  # back at the end of the retried step
    assert worker_kills["live"].all()
    status = worker_kills["status"]
    assert [x["rank"] for x in status["replacements"]] == [m, second]
    assert all("error" not in x for x in status["replacements"])
    replaced = [r for r in worker_kills["recoveries"] if r["reason"] == "replace"]
    assert [r["rejoined"] for r in replaced] == [[m], [second]]
    assert [r["step"] for r in replaced] == retried
    # the dead rank computed nothing in the retried step, its replacement from the next one
    steps = {s.step: s for s in worker_kills["steps"]}
    for rank, step in ((m, retried[0]), (second, retried[1])):
        assert steps[step].tokens_per_rank[rank] == 0
        assert all(steps[k].tokens_per_rank[rank] > 0 for k in range(step + 1, STEPS))
    assert worker_kills["nodes"] == worker_kills["rank_dcs"]  # pinned to the rank's DC
    # the new ranks train the same dense weights as the others, bit for bit
    first = worker_kills["dense"][0]
    for other in worker_kills["dense"][1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_one_master_per_expert(worker_kills: dict[str, Any]) -> None:
    lm = worker_kills["lm"]
    every = sorted((lyr, e) for lyr in range(lm.num_layers) for e in range(lm.num_experts))
    live = worker_kills["live"]
    for phy2log, master, route in worker_kills["plan"]:
        slots = phy2log.shape[1]
        mr = master // slots
        assert live[mr].all()
        assert (phy2log.reshape(-1)[master] == np.arange(master.shape[0])).all()
        assert live[route[:, 2]].all()
    # the replaced ranks hold copies again (the plan after rejoining is made afresh)
    for phy2log, _, _ in worker_kills["plan"]:
        assert (phy2log[list(worker_kills["dead"])] >= 0).any(axis=1).all()
    # in the data plane: every (layer, expert) has its Adam state on exactly one live rank
    assert sorted(worker_kills["masters"]) == every


def test_masters_restored_from_replica_and_disk_checkpoint(worker_kills: dict[str, Any]) -> None:
    key, held = worker_kills["replica"]
    first, second = [r for r in worker_kills["recoveries"] if r["reason"] == "step failed"]
    assert first["dead"] == [worker_kills["dead"][0]]
    assert first["restored_digests"][key] == held  # what the replica held, bit for bit
    assert first["lost_masters"] >= 1 and first["restored_from_replica"] >= 1
    assert second["dead"] == [worker_kills["dead"][1]]
    # the truncated newest checkpoint was refused; the one before it was used
    assert first["checkpoint_step"] == 1  # written after step 1 (every 2 steps)
    assert second["checkpoint"] != worker_kills["truncated"] and second["checkpoint_step"] == 3
    # masters restored from the checkpoint hold its weights, bit for bit (sha256)
    assert first["restored_from_checkpoint"] + second["restored_from_checkpoint"] >= 1
    for rec in (first, second):
        on_disk = worker_kills["ckpt_digests"][rec["checkpoint"]]
        assert len(rec["from_checkpoint"]) == rec["restored_from_checkpoint"]
        for k in rec["from_checkpoint"]:  # no live copy was left: a master that died
            assert rec["restored_digests"][k] == on_disk[k]
    assert all(r["seconds"] < 60 for r in worker_kills["recoveries"])


def test_without_replacement_a_dead_rank_stays_out(worker_kills: dict[str, Any]) -> None:
    rank, step, live, status, masters = worker_kills["no_replace"]
    lm = worker_kills["lm"]
    assert step.step == STEPS and step.error is None and math.isfinite(step.loss)
    assert status["retried_steps"][-1] == STEPS
    assert not live[rank] and status["dead_ranks"] == [rank]
    assert step.tokens_per_rank[rank] == 0
    assert len(status["replacements"]) == 2  # none more
    every = sorted((lyr, e) for lyr in range(lm.num_layers) for e in range(lm.num_experts))
    assert sorted(masters) == every
