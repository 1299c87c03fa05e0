"""What the SPMD members tests (test_spmd_no_replace.py, test_spmd_dc_cut.py) share: the
run they start, the reference check, and the figures of docs/reliability.md (with
``EXPERTMESH_MEMBERS_REPORT=FILE`` each module adds its members changes (pause, rejoin,
dead rank left out: seconds, what moved) and every step's wall time to FILE). The fault
tests (test_spmd_faults.py, test_spmd_controller.py) use the reference check too."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from expertmesh.controller.core import Trigger
from expertmesh.planner import Topology
from expertmesh.runtime.settings import RuntimeSettings
from expertmesh.workers.model import Corpus, LMConfig
from expertmesh.workers.reference import ReferenceLM

LM = LMConfig(num_layers=2, num_experts=8, top_k=2, hidden=16, ffn_hidden=16, batch=4, seq_len=32)
TOPOLOGY = Topology.generate(2, 2, masters=2, spare=2).with_inter_dc(0.5, 2.0)
CORPUS_BYTES = 200_000


def settings(**more: Any) -> RuntimeSettings:
    """2 DCs x 2 ranks, eplb planned every step, a checkpoint after every step (so nothing
    is lost to a members change and the run can equal the reference)."""
    return RuntimeSettings(
        topology=TOPOLOGY.to_dict(), lm=LM, policy="eplb", trigger=Trigger(mode="every_step"),
        corpus_bytes=CORPUS_BYTES, checkpoint_every=1, **more,
    )  # fmt: skip


def reference(step_ranks: list[tuple[int, list[int]]]) -> tuple[ReferenceLM, list[float]]:
    """The single-process reference of :data:`LM` trained on ``(step, ranks whose data it
    takes)`` in order: the model and its losses."""
    ref, corpus = ReferenceLM(LM), Corpus.load(None, CORPUS_BYTES)
    return ref, [ref.train_step(corpus, s, ranks) for s, ranks in step_ranks]


def assert_copies_equal(ref: ReferenceLM, weights: dict[tuple[int, int], list[Any]]) -> None:
    """Every copy held (``weights``: (layer, expert) -> per rank the copy or None) equals
    the reference's expert; every expert has one."""
    for (layer, e), copies in weights.items():
        expect = [t.detach().numpy() for t in ref.expert(layer, e)]
        held = [w for w in copies if w is not None]
        assert held, (layer, e)
        for w in held:
            for a, b in zip(w, expect, strict=True):
                np.testing.assert_allclose(a, b, atol=5e-6, err_msg=f"expert {layer}/{e}")


def assert_dense_equal(ref: ReferenceLM, dense: list[Any]) -> None:
    """A rank's dense weights (numpy, in ``parameters()`` order) equal the reference's."""
    want = [p.detach().numpy() for p in ref.dense.parameters()]
    for a, b in zip(dense, want, strict=True):
        np.testing.assert_allclose(a, b, atol=5e-6)


def write_report(module: str, changes: list[dict[str, Any]], steps: list[Any]) -> None:
    """``steps``: :class:`~expertmesh.runtime.settings.StepResult` of the run."""
    report = os.environ.get("EXPERTMESH_MEMBERS_REPORT")
    if not report:
        return
    path = Path(report)
    old = json.loads(path.read_text()) if path.exists() else {}
    old[module] = {
        "changes": changes,
        "steps": sorted([s.step, s.seconds, s.tokens_per_rank] for s in steps),
    }
    path.write_text(json.dumps(old, indent=1, default=str))
