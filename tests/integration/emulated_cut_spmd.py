"""Driver of test_spmd_emulate_cut.py, run inside the head DC's namespace of an emulation:
trains on the SPMD data plane (shaper off: the namespaces are the network), cuts a DC
pair with ``netemu cut`` (a real network cut the runtime is not told about), trains on,
heals, trains on; writes what happened as JSON.

    python emulated_cut_spmd.py NAME OUT.json
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from netemu_module import load_netemu  # this directory: run as a script

from expertmesh.controller.core import Trigger
from expertmesh.runtime.settings import RuntimeSettings
from expertmesh.runtime.spmd import SpmdRuntime
from expertmesh.workers.model import LMConfig

REPO = Path(__file__).resolve().parents[2]
TOPOLOGY = REPO / "deploy/topologies/emulate.yaml"
CUT = ("eu-west", "ap-south")  # not the head's DC: Ray's GCS keeps both nodes alive
BEFORE, DURING, AFTER = 2, 2, 2
LM = LMConfig(num_layers=2, num_experts=6, top_k=2, hidden=16, ffn_hidden=16, batch=4, seq_len=32)
GROUP_TIMEOUT_S = 8.0  # a collective across the cut fails after this long


def _plan(rt: SpmdRuntime) -> list[dict[str, Any]]:
    return [
        {"phy2log": p.tolist(), "route": r[:, [0, 2]].tolist()}
        for p, _, r in rt.committed_plan() or []
    ]


def _train(rt: SpmdRuntime, n: int) -> list[dict[str, Any]]:
    """``n`` steps one at a time, each with the wall time of its ``train`` call."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        (step,) = rt.train(1)
        out.append({**step.model_dump(), "train_wall_seconds": time.perf_counter() - t0})
    return out


def main(name: str, out: Path) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    netemu = load_netemu()
    em = netemu._load(name)
    settings = RuntimeSettings(
        topology=yaml.safe_load(TOPOLOGY.read_text()),
        lm=LM,
        policy="eplb",
        trigger=Trigger(mode="every_step"),
        shaper=False,  # the emulation's namespaces are the network
        corpus_bytes=100_000,
        checkpoint_every=1,
        step_deadline_s=GROUP_TIMEOUT_S,
    )
    res: dict[str, Any] = {}
    with SpmdRuntime(settings, address=em.address) as rt:
        res["rank_dc"] = rt.topology.rank_dc.tolist()
        res["before"] = _train(rt, BEFORE)
        netemu.cut(em, *CUT)
        try:
            res["during"] = _train(rt, DURING)
            res["plan_during"] = _plan(rt)
            res["status_cut"] = rt.status()
        finally:
            netemu.heal(em, *CUT)
        res["after"] = _train(rt, AFTER)
        res["plan_after"] = _plan(rt)
        res["status"] = rt.status()
        dense = [rt.dense(r) for r in range(rt.topology.num_ranks)]
        res["dense_equal"] = [
            all(np.array_equal(a, b) for a, b in zip(dense[0], d, strict=True)) for d in dense
        ]
    out.write_text(json.dumps(res, default=str))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
