"""Checkpoint benchmark: what writing the expert checkpoint to disk costs for the demo model.

The demo's defaults (3 DCs x 2 ranks, 2 master + 4 spare slots per rank; 2 MoE layers x 12
experts, width 32, FFN 64, batch 16 x 64 bytes per rank), every rank in this process
(``LocalExecutor``, no Ray). Measured, wall clock, medians over ``--repeats``:

- ``gather``: every rank's masters (weights, Adam m and v) copied out, as the driver asks
  the workers for them (``RankState.checkpoint``; on Ray the transfer comes on top);
- ``write``: :meth:`CheckpointDir.write` (npz + manifest, fsync, rename, prune to the
  newest 3) into ``--dir`` (default: a fresh directory under the system temp dir, where
  the runtime writes by default);
- ``load``: :meth:`CheckpointDir.load_latest` (manifest, size, sha256, arrays) as
  recovery does.

Baseline in the same run: the median of a whole training step of the same 6 ranks in
this process; ``x step`` is each cost over it.

    make bench-checkpoint     # or: python bench/bench_checkpoint.py [--repeats N] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _root in ("controller", "workers", "proto"):
    if str(REPO / _root) not in sys.path:
        sys.path.insert(0, str(REPO / _root))

from expertmesh.planner import Topology  # noqa: E402
from expertmesh.planner.static import static_placement  # noqa: E402
from expertmesh.runtime.checkpoint import CheckpointDir  # noqa: E402
from expertmesh.workers.engine import LocalExecutor, train_step  # noqa: E402
from expertmesh.workers.model import Corpus, LMConfig  # noqa: E402
from expertmesh.workers.rank import RankState  # noqa: E402


def wall_ms(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median wall-clock milliseconds of ``fn()`` over ``repeats``, and its last result."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dir", type=Path, help="checkpoint directory (default: a temp dir)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    cfg = LMConfig()
    topo = Topology.generate(3, 2, masters=2, spare=4)
    p = static_placement(topo.num_ranks, topo.slots_per_rank, cfg.num_experts, 2)
    corpus = Corpus.load(None, 400_000)
    ranks = [RankState(r, topo, cfg, corpus, [p] * cfg.num_layers) for r in range(topo.num_ranks)]
    ex = LocalExecutor(ranks)
    step = iter(range(10**6))
    train_step(ex, next(step), cfg.num_layers)  # warm-up; Adam moments are non-zero
    step_ms, _ = wall_ms(lambda: train_step(ex, next(step), cfg.num_layers),
                         max(3, args.repeats // 2))  # fmt: skip

    def gather() -> dict[tuple[int, int], Any]:
        out: dict[tuple[int, int], Any] = {}
        for part in ex.call_all("checkpoint"):
            out.update(part)
        return out

    gather_ms, experts = wall_ms(gather, args.repeats)
    with tempfile.TemporaryDirectory(prefix="expertmesh-bench-ckpt-") as tmp:
        ck = CheckpointDir(args.dir or Path(tmp) / "checkpoints", keep=3)
        n = iter(range(10**6))
        write_ms, written = wall_ms(
            lambda: ck.write(experts, step=next(n), plan_version=1, run="bench"), args.repeats
        )
        load_ms, loaded = wall_ms(lambda: ck.load_latest(run="bench"), args.repeats)
        assert len(loaded.experts) == cfg.num_layers * cfg.num_experts
        where = str(ck.root)
    rows = [("gather (6 ranks, in process)", gather_ms), ("write (npz + manifest, fsync, "
            "rename)", write_ms), ("load (sha256 + arrays)", load_ms)]  # fmt: skip
    print(f"demo model: {cfg.num_layers} layers x {cfg.num_experts} experts, "
          f"{len(experts)} masters, checkpoint {written.nbytes / 1e6:.2f} MB in {where}")  # fmt: skip
    print(f"baseline: one training step of the 6 ranks in this process {step_ms:.1f} ms")
    print(f"{'':34} {'ms (median)':>12} {'x step':>8}")
    for name, ms in rows:
        print(f"{name:34} {ms:12.2f} {ms / step_ms:8.3f}")
    print("load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "bytes": written.nbytes, "masters": len(experts), "step_ms": step_ms,
            "gather_ms": gather_ms, "write_ms": write_ms, "load_ms": load_ms,
            "repeats": args.repeats, "dir": where,
        }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
