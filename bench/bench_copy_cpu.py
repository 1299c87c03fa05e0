"""CPU per rank of one SPMD step by layout (docs/cost-model.md, the SPMD step's ``h``):
the demo model (``LMConfig()``) on ``D`` DCs x 2 ranks as real gloo processes on this
machine, without Ray, the link shaper or the controller, static EP against the replicated
layout (``RuntimeSettings.layout``), free links. Per rank: median wall seconds of forward
+ backward and of the sync, and of CPU seconds (``time.process_time``: the process's
threads, gloo's included) of the step and of its sync, over ``STEPS`` steps after 3
warm-up steps; ``1`` as the last argument: a CPU-time profile of rank 0 (cProfile).

    /work/notes/quiet .venv/bin/python bench/bench_copy_cpu.py static 3 12 0
    /work/notes/quiet .venv/bin/python bench/bench_copy_cpu.py replicated 3 12 0
"""

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
for _root in ("controller", "workers", "proto", "bench", "tests/integration"):
    if str(REPO / _root) not in sys.path:
        sys.path.insert(0, str(REPO / _root))

from spmd_procs import run_ranks  # noqa: E402 (after the source roots)


def placements(kind: str, dcs: int) -> list:
    """bench_runtime.py's topology of ``dcs`` DCs x 2 ranks: static EP or the replicated
    layout (every DC holds every expert), per layer."""
    from bench_runtime import topology

    from expertmesh.runtime.settings import initial_placements
    from expertmesh.workers.model import LMConfig

    lm = LMConfig()
    topo = topology(dcs, 1e4, 0.0, lm.num_experts)
    return initial_placements(topo, lm, "static" if kind == "static" else "replicated")


def rank_fn(comm: object, kind: str, dcs: int, steps: int, prof: bool) -> dict:
    """One rank: 3 warm-up steps, then ``steps`` timed ones."""
    from expertmesh.workers.model import Corpus, LMConfig
    from expertmesh.workers.spmd import SpmdRank

    cfg = LMConfig()
    st = SpmdRank(comm, cfg, Corpus.load(None, 300_000), placements(kind, dcs))  # type: ignore[arg-type]
    for s in range(3):
        st.train_step(s)
    pr = cProfile.Profile(time.process_time)
    fb, sy, cpu, cs = [], [], [], []
    sync = st.sync
    box: dict[str, float] = {}

    def timed(offer: int = 0) -> None:
        box["c"] = time.process_time()
        sync(offer)
        box["d"] = time.process_time()

    st.sync = timed  # type: ignore[method-assign]
    for s in range(3, 3 + steps):
        c0 = time.process_time()
        if prof:
            pr.enable()
        st.train_step(s)
        if prof:
            pr.disable()
        cpu.append(time.process_time() - c0)
        cs.append(box["d"] - box["c"])
        fb.append(st.seconds["forward_backward"])
        sy.append(st.seconds["sync"])
    out = {
        "fb": float(np.median(fb)),
        "sync": float(np.median(sy)),
        "cpu": float(np.median(cpu)),
        "cpu_sync": float(np.median(cs)),
        "held": [len(m.held()) for m in st.layers],
    }
    if prof:
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(25)
        out["prof"] = text.getvalue()
    return out


def main() -> None:
    kind, dcs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    prof = len(sys.argv) > 4 and sys.argv[4] == "1"
    rank_dc = np.repeat(np.arange(dcs), 2)
    t0 = time.time()
    res = run_ranks(rank_fn, rank_dc, kind, dcs, steps, prof, timeout=300)
    print(kind, dcs, "DCs, wall", round(time.time() - t0, 1), "s")
    for r, o in enumerate(res):
        print(r, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in o.items()
                  if k != "prof"})  # fmt: skip
    print(
        "CPU per rank per step, mean over ranks:",
        round(float(np.mean([o["cpu"] for o in res])), 4),
        "s, of it the sync:",
        round(float(np.mean([o["cpu_sync"] for o in res])), 4),
        "s",
    )
    if prof:
        print(res[0]["prof"])


if __name__ == "__main__":
    main()
