"""Checkpoint benchmark: what the SPMD runtime's checkpoint costs for the demo model.

The demo's own settings (``expertmesh demo``'s parser and defaults, with
``--checkpoint-every 1`` and no surfaces) train ``--steps`` steps on a local Ray cluster,
one checkpoint after every step. Measured in that run, wall clock, medians:

- ``gather``: the driver asks the workers for every master (weights, Adam m and v) and
  one worker for the resume state (dense weights and Adam state, plan, counters), over Ray;
- ``write``: :meth:`CheckpointDir.write` (npz + manifest, fsync, rename, prune);
- ``load``: :meth:`CheckpointDir.load_latest` (manifest, size, sha256, arrays), as a
  recovery or ``demo --resume`` reads it, repeated ``--repeats`` times after the run.

Baseline in the same run: the median end-to-end step (``seconds``); ``x step`` is each
cost over it. The checkpoint is written between chunks of steps, so at the default of
every 5 steps its share of a step is a fifth of the ``gather + write`` row.

    make bench-checkpoint     # or: python bench/bench_checkpoint.py [--steps N] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _root in ("controller", "workers", "proto"):
    if str(REPO / _root) not in sys.path:
        sys.path.insert(0, str(REPO / _root))

from expertmesh.cli import demo  # noqa: E402
from expertmesh.runtime.checkpoint import CheckpointDir  # noqa: E402
from expertmesh.runtime.spmd import SpmdRuntime  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=10, help="loads timed after the run")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    if args.steps < 3 or args.repeats < 1:
        ap.error("--steps must be >= 3 and --repeats >= 1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    root = tempfile.mkdtemp(prefix="expertmesh-bench-ckpt-")
    parser = argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    demo_args = parser.parse_args(
        ["demo", "--checkpoint-every", "1", "--checkpoint-dir", root, "--no-serve"]
    )
    settings = demo.build_settings(demo_args)
    with SpmdRuntime(settings) as rt:
        rows = rt.train(args.steps)
        log = [c for c in rt.checkpoint_log if c["step"] >= 1]  # after warm-up steps
    step_ms = 1e3 * statistics.median(r.seconds or r.step_seconds for r in rows[1:])
    gather = 1e3 * statistics.median(c["gather_seconds"] for c in log)
    write = 1e3 * statistics.median(c["write_seconds"] for c in log)
    loads = []
    ckdir = CheckpointDir(root)
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        ckdir.load_latest()
        loads.append(time.perf_counter() - t0)
    load = 1e3 * statistics.median(loads)
    mb = statistics.median(c["bytes"] for c in log) / 1e6
    with open("/proc/loadavg") as fh:
        loadavg = fh.read().split()[:3]
    print(f"demo model, SPMD runtime on local Ray, {args.steps} steps, a checkpoint after each")
    print(f"checkpoint {mb:.2f} MB; median step {step_ms:.1f} ms; load average {loadavg}")
    print(f"{'operation (median, wall clock)':42s} {'ms':>8s} {'x step':>8s}")
    figures = {"gather": gather, "write": write, "gather + write": gather + write, "load": load}
    for name, ms in figures.items():
        print(f"{name:42s} {ms:8.1f} {ms / step_ms:8.3f}")
    if args.json:
        args.json.write_text(
            json.dumps({"step_ms": step_ms, "mb": mb, "ms": figures, "loadavg": loadavg}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
