"""What runs on a CUDA device, timed there (the device check of docs/benchmarks.md, "On a GPU").

1. **The per-microbatch quota with the counts on the device** (``quota_torch.balance``):
   the domains and loads of ``bench_balance.py`` (R = 8, 16, 64 ranks, 4R experts, top-8,
   8192 tokens per rank, static max/mean 1.5-3.0, seeds 0..2), the counts a CUDA tensor
   as a worker's gate leaves them. Contenders, each until the split is usable on the
   device (``torch.cuda.synchronize``):
   - ``torch``: ``impl="torch"`` (the decision on the host from one ``[E]`` copy, the
     ``[C, R_src]`` split in torch on the device);
   - ``numpy``: ``impl="numpy"`` (and ``"auto"``): the counts copied to the host, solved
     in numpy, every result copied back to the device;
   - ``numpy, host counts``: ``balance_domain`` on host arrays, no copies (the CPU
     worker's path; the floor for the host solve).
   Every contender gives the same ``T`` and split (checked on every load).
2. **One training step of the data plane on the device**: one rank (``SpmdRank``, NCCL
   world of 1 on CUDA; gloo on this machine's CPU, one thread as the workers run), a model
   where the experts are most of the work (hidden 256, expert FFN 1024, 16 experts,
   top-2, 2 layers, 16 x 128 tokens); median of the steps after the warm-up.

Wall seconds (the device works asynchronously: process CPU time says nothing), medians.

    python bench/bench_gpu.py [--repeats N] [--json out.json]   # needs CUDA
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
for _root in ("controller", "workers", "proto", "bench"):
    if str(REPO / _root) not in sys.path:
        sys.path.insert(0, str(REPO / _root))

from bench_balance import MASTERS, SIZES, SPARE, loads, median_seconds  # noqa: E402

from expertmesh.planner.fastquota import EXACT, balance_domain  # noqa: E402
from expertmesh.planner.static import static_placement  # noqa: E402

STEP_CFG = {
    "num_layers": 2, "num_experts": 16, "top_k": 2, "hidden": 256, "ffn_hidden": 1024,
    "seq_len": 128, "batch": 16,
}  # fmt: skip


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def quota_rows(dev: torch.device, seeds: int, repeats: int) -> list[dict[str, Any]]:
    from expertmesh.workers.quota_torch import balance

    def on_device(impl: str, counts: torch.Tensor, p2l: torch.Tensor) -> Any:
        sol = balance(counts, p2l, EXACT, impl=impl)  # type: ignore[arg-type]
        _sync(dev)
        return sol

    rows = []
    for num_ranks in SIZES:
        masters = static_placement(num_ranks, MASTERS + SPARE, MASTERS * num_ranks, MASTERS)
        p2l = torch.from_numpy(masters.phy2log.astype(np.int64)).to(dev)
        times: dict[str, list[float]] = {}
        for _, load in loads(num_ranks, seeds):
            counts = torch.from_numpy(load).to(dev)
            want = balance_domain(load, masters.phy2log, EXACT)
            for impl in ("torch", "numpy"):
                sol = on_device(impl, counts, p2l)
                split = torch.as_tensor(sol.split)
                if split.device != dev:
                    raise SystemExit(f"R={num_ranks}: impl={impl} left the split on {split.device}")
                if sol.quota != want.quota or not np.array_equal(split.cpu().numpy(), want.split):
                    raise SystemExit(f"R={num_ranks}: impl={impl} differs from balance_domain")
            fns: dict[str, Callable[[], object]] = {
                "torch": partial(on_device, "torch", counts, p2l),
                "numpy": partial(on_device, "numpy", counts, p2l),
                "numpy, host counts": partial(balance_domain, load, masters.phy2log, EXACT),
            }
            for name, sec in median_seconds(
                fns, repeats, clock=time.perf_counter, warmups=2
            ).items():
                times.setdefault(name, []).append(sec)
        row: dict[str, Any] = {"ranks": num_ranks, "loads": len(times["torch"])}
        row.update({f"{k} ms": 1e3 * statistics.median(v) for k, v in times.items()})
        rows.append(row)
    return rows


def step_seconds(dev: torch.device, steps: int) -> dict[str, Any]:
    """Median step of one rank training ``STEP_CFG`` on ``dev`` (a world of 1)."""
    import torch.distributed as dist

    from expertmesh.planner import Topology
    from expertmesh.workers.comm import Comm, pick_backend
    from expertmesh.workers.model import Corpus, LMConfig
    from expertmesh.workers.spmd import SpmdRank

    cfg = LMConfig(**STEP_CFG)  # type: ignore[arg-type]
    corpus = Corpus(bytes(range(256)) * 64)
    backend = pick_backend(dev)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            backend, init_method=f"file://{tmp}/store", rank=0, world_size=1,
            timeout=datetime.timedelta(seconds=120),
        )  # fmt: skip
        try:
            topo = Topology.generate(1, 1, masters=cfg.num_experts, spare=1)
            comm = Comm(0, topo.rank_dc, [0], device=dev)
            p = static_placement(1, topo.slots_per_rank, cfg.num_experts, topo.masters_per_rank)
            rank = SpmdRank(comm, cfg, corpus, [p] * cfg.num_layers)
            times = []
            for s in range(steps):
                t0 = time.perf_counter()
                rank.train_step(s)
                _sync(dev)
                times.append(time.perf_counter() - t0)
        finally:
            dist.destroy_process_group()
    warm = min(3, steps - 1)
    return {"device": str(dev), "backend": backend, "median step s": statistics.median(times[warm:]),
            "steps timed": steps - warm, "loss": rank.loss}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="loads per imbalance")
    ap.add_argument("--repeats", type=int, default=30, help="timed solves per load (median)")
    ap.add_argument("--steps", type=int, default=13, help="training steps per device (3 warm)")
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script only")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device on this machine", file=sys.stderr)
        return 2
    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    torch.backends.cudnn.allow_tf32 = False  # fp32 as on the CPU
    torch.backends.cuda.matmul.allow_tf32 = False
    out: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if dev.type == "cuda" else None,
        "cpu threads": os.cpu_count(),
    }
    out["quota"] = quota_rows(dev, args.seeds, args.repeats)
    for row in out["quota"]:
        print("quota", json.dumps(row))
    out["step"] = [step_seconds(dev, args.steps), step_seconds(torch.device("cpu"), args.steps)]
    gpu, cpu = (r["median step s"] for r in out["step"])
    out["step cpu / gpu"] = cpu / gpu
    for row in out["step"]:
        print("step", json.dumps(row))
    print(f"step: CPU (one thread) / GPU = {cpu / gpu:.1f}x")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
