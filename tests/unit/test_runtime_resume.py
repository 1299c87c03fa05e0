"""What a resume and a restarted controller rest on, without Ray: the checkpoint's extra
part (round trip, refused when missing, misnamed or misshaped), ``load_resume``'s checks
(settings that must match, a malformed plan), the version floor of a restarted controller
(``reserve_versions``, ``adopt``, the store's ``note_issued``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from expertmesh.controller.core import ControllerCore, ControllerSettings, PlanState, Trigger
from expertmesh.controller.store import SqlitePlanStore
from expertmesh.planner import ModelSpec, Topology
from expertmesh.runtime.checkpoint import CheckpointDir, CheckpointError
from expertmesh.runtime.resume import load_resume, resume_payload
from expertmesh.runtime.settings import RuntimeSettings, initial_placements
from expertmesh.workers.model import DenseModel, LMConfig, init_expert
from expertmesh.workers.wire import WireFormat

LM = LMConfig(num_layers=2, num_experts=4, top_k=2, hidden=8, ffn_hidden=8, batch=2, seq_len=8)


def _settings(**lm: int) -> RuntimeSettings:
    topo = Topology.generate(2, 1, masters=2, spare=1)
    return RuntimeSettings(
        topology=topo.to_dict(), lm=LM.model_copy(update=lm), corpus_bytes=20_000
    )


def _write(root: Path, settings: RuntimeSettings, step: int = 4) -> Path:
    """A checkpoint as the SPMD driver writes it (a rank's state after ``step``)."""
    dense = list(DenseModel(settings.lm).parameters())
    topo = Topology.from_dict(settings.topology)
    state = {
        "dense": [p.detach() + 1 for p in dense],
        "dense_state": [(torch.full_like(p, 0.5), torch.full_like(p, 0.25)) for p in dense],
        "step": step,
        "opt_step": step + 1,
        "expert_step": step + 1,
        "version": 3,
        "wire": WireFormat(),
        "layers": [(p.phy2log, p.master, np.zeros((0, 4), np.int64))
                   for p in initial_placements(topo, settings.lm)],
    }  # fmt: skip
    experts = {
        (layer, e): ([t.numpy() for t in init_expert(settings.lm, layer, e)],) * 3
        for layer in range(settings.lm.num_layers)
        for e in range(settings.lm.num_experts)
    }
    extra, arrays = resume_payload(state, settings)
    ck = CheckpointDir(root).write(
        experts, step=step, plan_version=3, run="r1", extra=extra, arrays=arrays
    )
    return ck.path


def test_the_resume_state_round_trips(tmp_path: Path) -> None:
    s = _settings()
    _write(tmp_path, s)
    rs = load_resume(tmp_path, s)
    assert (rs.step, rs.version, rs.run) == (4, 3, "r1")
    state = rs.worker_state()
    assert (state["opt_step"], state["expert_step"], state["version"]) == (5, 5, 3)
    assert rs.extra["next_step"] == 5  # the data position
    for got, p in zip(state["dense"], DenseModel(s.lm).parameters(), strict=True):
        torch.testing.assert_close(got, p.detach() + 1)
    assert all(float(m.mean()) == 0.5 and float(v.mean()) == 0.25 for m, v in state["dense_state"])
    assert sorted(rs.seeds(0)) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # what rank 0 holds


@pytest.mark.parametrize(
    ("change", "message"),
    [({"num_experts": 2}, "lm.num_experts=4"), ({"seed": 7}, "lm.seed=0"),
     ({"hidden": 16}, "lm.hidden=8")],
)  # fmt: skip
def test_settings_that_must_match_are_refused(
    tmp_path: Path, change: dict[str, int], message: str
) -> None:
    _write(tmp_path, _settings())
    with pytest.raises(CheckpointError, match=message):
        load_resume(tmp_path, _settings(**change))


def test_another_corpus_or_topology_is_refused(tmp_path: Path) -> None:
    s = _settings()
    _write(tmp_path, s)
    with pytest.raises(CheckpointError, match="corpus_bytes"):
        load_resume(tmp_path, s.model_copy(update={"corpus_bytes": 30_000}))
    topo = Topology.generate(2, 1, masters=2, spare=2)
    with pytest.raises(CheckpointError, match="topology"):
        load_resume(tmp_path, s.model_copy(update={"topology": topo.to_dict()}))


def test_a_malformed_plan_or_missing_array_is_refused(tmp_path: Path) -> None:
    s = _settings()
    path = _write(tmp_path / "a", s)
    man = json.loads((path / "manifest.json").read_text())
    assert "plan.0.master" in man["extra_arrays"]
    man["extra_arrays"].append("dense.w99")  # named, not in the data file
    (path / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CheckpointError, match=r"x\.dense\.w99 is missing"):
        CheckpointDir(tmp_path / "a").load(path)
    man["extra_arrays"] = ["../../etc/passwd"]
    (path / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CheckpointError, match=r"not a .* manifest"):
        CheckpointDir(tmp_path / "a").load(path)
    # a plan whose master slot holds another expert
    bad = tmp_path / "b"
    dense = list(DenseModel(s.lm).parameters())
    topo = Topology.from_dict(s.topology)
    p = initial_placements(topo, s.lm)[0]
    master = p.master.copy()
    master[[0, 1]] = master[[1, 0]]
    state = {
        "dense": dense, "dense_state": [(p2, p2) for p2 in dense], "step": 0, "opt_step": 1,
        "expert_step": 1, "version": 1, "wire": WireFormat(),
        "layers": [(p.phy2log, master, np.zeros((0, 4), np.int64))] * 2,
    }  # fmt: skip
    experts = {
        (la, e): ([t.numpy() for t in init_expert(s.lm, la, e)],) * 3
        for la in range(2)
        for e in range(4)
    }
    extra, arrays = resume_payload(state, s)
    CheckpointDir(bad).write(experts, step=0, plan_version=1, run="r", extra=extra, arrays=arrays)
    with pytest.raises(CheckpointError, match="committed plan of layer 0 is malformed"):
        load_resume(bad, s)


def test_an_older_checkpoint_is_used_when_the_newest_is_corrupt(tmp_path: Path) -> None:
    s = _settings()
    _write(tmp_path, s, step=4)
    newest = _write(tmp_path, s, step=9)
    (newest / "experts.npz").write_bytes(b"garbage")
    assert load_resume(tmp_path, s).step == 4


def _core(store: SqlitePlanStore | None = None) -> ControllerCore:
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    core = ControllerCore(
        topo,
        ModelSpec(num_layers=1, num_experts=8, top_k=2),
        ControllerSettings(trigger=Trigger(mode="every_step")),
        store=store,
    )
    rng = np.random.default_rng(0)
    for r in range(4):
        core.report_load(0, 0, r, rng.integers(0, 20, 8))
    return core


def test_plans_are_numbered_above_every_version_handed_out(tmp_path: Path) -> None:
    store = SqlitePlanStore(tmp_path / "plans.sqlite")
    assert store.issued_version() == 0
    store.note_issued(6)
    store.close()
    store = SqlitePlanStore(tmp_path / "plans.sqlite")  # a restarted controller reads it
    core = _core(store)
    core.reserve_versions(store.issued_version())
    core.reserve_versions(2)  # never back down
    assert core.plan(0).version == 7


def test_an_adopted_offer_commits_like_any_other(tmp_path: Path) -> None:
    store = SqlitePlanStore(tmp_path / "plans.sqlite")
    core = _core(store)
    pv = core.plan(0)
    other = _core()
    other.adopt(pv.__class__(**{**pv.__dict__, "version": 5, "state": PlanState.PREPARED}))
    with pytest.raises(ValueError, match="cannot be adopted"):
        other.adopt(pv.__class__(**{**pv.__dict__, "version": 5}))
    assert other.commit(5).state == PlanState.COMMITTED
    assert other.plan(0).version == 6
