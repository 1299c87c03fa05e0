"""Driver of test_emulate_cut.py, run inside the head DC's namespace of an emulation:
trains on it, cuts a DC pair with ``netemu cut`` (a real network cut the runtime is not
told about), trains on, heals, trains on; writes what happened as JSON.

    python emulated_cut.py NAME OUT.json
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from netemu_module import load_netemu  # this directory: run as a script

from expertmesh.controller.core import Trigger
from expertmesh.runtime.cluster import Runtime, RuntimeSettings
from expertmesh.workers.model import LMConfig

REPO = Path(__file__).resolve().parents[2]
TOPOLOGY = REPO / "deploy/topologies/emulate.yaml"
CUT = ("eu-west", "ap-south")  # not the head's DC: Ray's GCS keeps both nodes alive
BEFORE, DURING, AFTER = 2, 2, 2
LM = LMConfig(num_layers=2, num_experts=6, top_k=2, hidden=16, ffn_hidden=16, batch=4, seq_len=32)


def _plan(rt: Runtime) -> list[dict[str, Any]]:
    return [
        {"phy2log": p.tolist(), "route": r[:, [0, 2]].tolist()}
        for p, _, r in rt.committed_plan() or []
    ]


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
        checkpoint_every=2,
        step_deadline_s=8.0,
    )
    res: dict[str, Any] = {}
    with Runtime(settings, address=em.address) as rt:
        res["rank_dc"] = rt.topology.rank_dc.tolist()
        res["before"] = [rt.run_step().model_dump() for _ in range(BEFORE)]
        netemu.cut(em, *CUT)
        try:
            res["during"] = []
            for _ in range(DURING):
                t0 = time.perf_counter()
                res["during"].append(rt.run_step().model_dump())
                res["during"][-1]["wall_seconds"] = time.perf_counter() - t0
                res.setdefault("plan_during", _plan(rt))
            res["status_cut"] = rt.status()
        finally:
            netemu.heal(em, *CUT)
        res["after"] = []
        for _ in range(AFTER):
            t0 = time.perf_counter()
            res["after"].append(rt.run_step().model_dump())
            res["after"][-1]["wall_seconds"] = time.perf_counter() - t0
        res["plan_after"] = _plan(rt)
        res["status"] = rt.status()
        res["deadline_s"] = rt.step_deadline_s
    out.write_text(json.dumps(res, default=str))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
