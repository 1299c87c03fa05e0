"""Load ingestion at 1,000 DCs x 8 ranks x 58 MoE layers (`make bench-api`, second part).

The controller's ingestion time per training step, with and without hierarchical load
aggregation (docs/architecture.md), each configuration in a fresh spawned process pinned
to one CPU core (its peak RSS is its own):

- ``per-rank, core``: every rank's [E] counts of every layer every step, one
  ``ControllerCore.report_batch`` per rank per step (the [L, E] message the gRPC fast
  path hands the core), and ``report_load`` per report (the runtime's path today).
- ``per-rank, gRPC``: the same over ``ReportLoad`` (one stream and message per rank per
  step, 58 reports in it) from a load generator in another process, on the other core.
- ``windows, core``: each DC's aggregator output, one ``WindowReport`` per DC per layer per
  window of ``--window`` steps, through ``ControllerCore.report_windows`` (one call per DC):
  as ``L`` reports, or as one ``WindowBlock`` of the DC's ``L`` layers.
  The ``[R, E]`` window means are made when a plan or query first asks
  (``WindowMean``), not at ingestion: their cost, once per window for every layer, is
  printed apart ("means on demand").
- ``windows, gRPC``: the same over ``ReportWindows``, one message per DC per window: ``L``
  ``WindowReport`` messages with varint counts (the wire format before ``DcWindowReport``),
  or one ``DcWindowReport`` with the counts as packed little-endian bytes: int64 (the form
  before ``count_width``) or the narrowest width that holds them (what the client sends
  now: uint16 here); and, for a regional aggregator, ``--dcs-per-message`` DCs'
  ``DcWindowReport``s in one message.

Per step = the window's time / ``--window``. "CPU s/step" is the controller process's CPU
time (every thread) over the ingestion, per step. Simulated ranks: loads are random
counts; the DCs' window sums are made with numpy (a DC aggregator's own cost, on its DC,
is measured apart by feeding one real ``DcAggregator`` a DC's reports for a window and
checking its output). Nothing lost: sent == accepted == received by the core, 0
rejected, every step or window complete, and the aggregated per-rank report count
reconciles. Prints a table (medians over ``--repeats``) and ratios against the per-rank
core path of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import time
from typing import Any

import numpy as np

from expertmesh.controller.core import ControllerCore, ControllerSettings
from expertmesh.planner import ModelSpec, Topology
from expertmesh.planner.window import WindowBlock, WindowReport


def _pin(core_index: int) -> int | None:
    """Pin this process to one core; and, as `expertmesh serve` does, serve buffers of 1 MiB
    and more from their own mmap (freed [R, E] loads go back to the OS, not to a heap that
    fragments)."""
    from expertmesh.cli.serve import big_buffers_to_mmap

    big_buffers_to_mmap()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    cpu = cpus[core_index % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    return cpu


def _core(a: dict[str, Any]) -> ControllerCore:
    topo = Topology.generate(dcs=a["dcs"], ranks_per_dc=a["ranks_per_dc"], masters=1, spare=1)
    model = ModelSpec(num_layers=a["layers"], num_experts=a["experts"], top_k=8)
    # one complete load kept per layer: each is [R, E] int64 (16 MB at 8,000 x 256)
    return ControllerCore(topo, model, ControllerSettings(window=1, max_pending_steps=2))


def _blocks(a: dict[str, Any], w: int, rng: np.random.Generator) -> list[WindowBlock]:
    """Per DC, one block of its ``L`` window reports for window ``w`` (the same sums as
    :func:`_windows` with the same generator state)."""
    return [WindowBlock.of(reps)[0] for reps in _windows(a, w, rng)]  # type: ignore[misc]


def _windows(a: dict[str, Any], w: int, rng: np.random.Generator) -> list[list[WindowReport]]:
    """Per DC, its ``L`` window reports for window ``w`` (simulated aggregator output)."""
    n, window = a["ranks_per_dc"], a["window"]
    sums = rng.integers(0, 64 * n * window, (a["dcs"], a["layers"], a["experts"]))
    return [
        [
            WindowReport(
                first_step=w * window,
                last_step=(w + 1) * window - 1,
                layer=layer,
                dc=d,
                steps=window,
                reports=n * window,
                load=sums[d, layer],
            )
            for layer in range(a["layers"])
        ]
        for d in range(a["dcs"])
    ]


def _result(core: ControllerCore, wall: float, cpu: float, steps: int, **kw: Any) -> dict:
    return {
        "wall_per_step": wall / steps,
        "cpu_per_step": cpu / steps,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "received": core.reports_received,
        "rejected": core.reports_rejected,
        "complete": sum(
            core.layer_newest_step(i) is not None for i in range(core.model.num_layers)
        ),
        "newest": [core.layer_newest_step(i) for i in range(core.model.num_layers)],
        **kw,
    }


# ---- in-process configurations ----


def _per_rank_core(a: dict[str, Any], how: str, out: Any) -> None:
    _pin(0)
    core = _core(a)
    rng = np.random.default_rng(0)
    num_ranks, num_layers = core.topology.num_ranks, a["layers"]
    loads = rng.integers(0, 64, (num_ranks, num_layers, a["experts"]))  # [R, L, E] per step
    layers = np.arange(num_layers)
    wall = cpu = 0.0
    for step in range(a["rank_steps"]):
        steps = np.full(num_layers, step)
        t0, c0 = time.perf_counter(), time.process_time()
        if how == "batch":
            for r in range(num_ranks):
                core.report_batch(steps, layers, np.full(num_layers, r), loads[r])
        else:
            for r in range(num_ranks):
                for layer in range(num_layers):
                    core.report_load(step, layer, r, loads[r, layer])
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
    sent = num_ranks * num_layers * a["rank_steps"]
    out.put(_result(core, wall, cpu, a["rank_steps"], sent=sent, accepted=sent))


def _windows_core(a: dict[str, Any], how: str, out: Any) -> None:
    _pin(0)
    core = _core(a)
    rng = np.random.default_rng(0)
    wall = cpu = 0.0
    accepted = 0
    for w in range(a["windows"]):
        # built before timing: the aggregators' output, per DC its L reports or one block
        per_dc: list[Any] = _windows(a, w, rng) if how == "reports" else _blocks(a, w, rng)
        t0, c0 = time.perf_counter(), time.process_time()
        for reps in per_dc:
            accepted += core.report_windows(reps if how == "reports" else [reps])[0]
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
    sent = a["dcs"] * a["layers"] * a["windows"]
    steps = a["windows"] * a["window"]
    res = _result(core, wall, cpu, steps, sent=sent, accepted=accepted)
    res["rank_reports"] = core.windows_in.rank_reports
    t0 = time.perf_counter()
    for layer in range(a["layers"]):  # what the first plan (or query) of a window makes
        core.loads.newest(layer)
    res["means_seconds"] = time.perf_counter() - t0
    out.put(res)


# ---- over gRPC: the controller here, the load generator in a child ----


def _client(target: str, kind: str, a: dict[str, Any], go: Any, out: Any) -> None:
    import grpc

    from expertmesh.v1 import convert
    from expertmesh.v1 import expertmesh_pb2 as pb

    _pin(1)
    rng = np.random.default_rng(0)
    # serialize everything first: the generator should spend its CPU on sending
    resp_type: Any  # the response message class of the method
    if kind == "rank":
        num_ranks = a["dcs"] * a["ranks_per_dc"]
        loads = rng.integers(0, 64, (num_ranks, a["layers"], a["experts"]))
        rounds = [
            [
                pb.ReportLoadRequest(
                    reports=[
                        pb.LoadReport(step=s, layer=layer, rank=r, load=loads[r, layer].tolist())
                        for layer in range(a["layers"])
                    ]
                ).SerializeToString()
                for r in range(num_ranks)
            ]
            for s in range(a["rank_steps"])
        ]
        method, resp_type = "ReportLoad", pb.ReportLoadResponse
    elif kind == "window":  # one message per DC per window: L WindowReports, varint counts
        rounds = [
            [
                pb.ReportWindowsRequest(
                    reports=[convert.window_to_msg(x) for x in reps]
                ).SerializeToString()
                for reps in _windows(a, w, rng)
            ]
            for w in range(a["windows"])
        ]
        method, resp_type = "ReportWindows", pb.ReportWindowsResponse
    else:  # one DcWindowReport per DC per window, counts as packed bytes
        width = pb.COUNT_WIDTH_INT64 if kind == "block64" else None  # None: the narrowest
        per = a["dcs_per_message"] if kind == "region" else 1
        rounds = []
        for w in range(a["windows"]):
            blocks: list[Any] = _blocks(a, w, rng)
            rounds.append(
                [
                    convert.windows_to_msg(blocks[i : i + per], width=width).SerializeToString()
                    for i in range(0, len(blocks), per)
                ]
            )
        method, resp_type = "ReportWindows", pb.ReportWindowsResponse

    async def run() -> None:
        channels = [grpc.aio.insecure_channel(target) for _ in range(8)]
        for ch in channels:
            await ch.channel_ready()
        path = f"/expertmesh.v1.ExpertMeshService/{method}"
        if kind == "rank":
            calls = [ch.stream_unary(path, lambda b: b, resp_type.FromString) for ch in channels]
        else:
            calls = [ch.unary_unary(path, lambda b: b, resp_type.FromString) for ch in channels]
        sem = asyncio.Semaphore(128)
        go.put("ready")
        go.get()  # the server has started its clocks
        accepted = 0
        for msgs in rounds:  # a step (or window) at a time, as training produces them

            async def send(i: int, m: bytes) -> int:
                async with sem:
                    arg: Any = iter([m]) if kind == "rank" else m
                    return int((await calls[i % len(calls)](arg)).accepted)

            accepted += sum(await asyncio.gather(*(send(i, m) for i, m in enumerate(msgs))))
        for ch in channels:
            await ch.close()
        out.put({"accepted": accepted})

    asyncio.run(run())


def _over_grpc(a: dict[str, Any], kind: str, out: Any) -> None:
    from expertmesh.controller.server import Surfaces
    from expertmesh.controller.settings import SurfaceSettings

    _pin(0)
    core = _core(a)
    ctx = mp.get_context("spawn")
    with Surfaces(core, SurfaceSettings(rest_port=0, grpc_port=0)) as s:
        go, back = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_client, args=(s.grpc_target, kind, a, go, back))
        p.start()
        _wait(go, p)
        t0, c0 = time.perf_counter(), time.process_time()
        go.put("go")
        res = _wait(back, p)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        p.join(30)
    if kind == "rank":
        steps, sent = a["rank_steps"], a["dcs"] * a["ranks_per_dc"] * a["layers"] * a["rank_steps"]
    else:
        steps, sent = a["windows"] * a["window"], a["dcs"] * a["layers"] * a["windows"]
    r = _result(core, wall, cpu, steps, sent=sent, accepted=res["accepted"])
    r["rank_reports"] = core.windows_in.rank_reports
    out.put(r)


def _wait(q: Any, p: Any) -> Any:
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"process exited with code {p.exitcode}") from None


def _spawn(target: Any, *args: Any) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    try:
        return _wait(q, p)
    finally:
        p.join(60)


def aggregator_cost(a: dict[str, Any]) -> dict[str, Any]:
    """One real DcAggregator fed a DC's reports for one window: its seconds per step, and
    whether its output equals the numpy sums the other configurations simulate."""
    from expertmesh.workers.aggregate import DcAggregator

    n, num_layers, window = a["ranks_per_dc"], a["layers"], a["window"]
    agg = DcAggregator(0, list(range(n)), num_layers, a["experts"], window)
    loads = np.random.default_rng(0).integers(0, 64, (window, n, num_layers, a["experts"]))
    out: list[WindowReport] = []
    t0 = time.perf_counter()
    for t in range(window):
        for r in range(n):
            out += agg.add_step(t, r, loads[t, r])
    seconds = time.perf_counter() - t0
    exact = len(out) == num_layers and all(
        np.array_equal(w.load, loads[:, :, w.layer].sum(axis=(0, 1))) for w in out
    )
    return {"seconds_per_step": seconds / window, "exact": exact, "reports": agg.reports_sent}


def _ok(r: dict[str, Any], a: dict[str, Any], windows: bool) -> bool:
    last = a["windows"] * a["window"] - 1 if windows else a["rank_steps"] - 1
    good = (
        r["sent"] == r["accepted"] == r["received"]
        and r["rejected"] == 0
        and r["complete"] == a["layers"]
        and all(s == last for s in r["newest"])
    )
    if windows:
        good &= r["rank_reports"] == a["dcs"] * a["ranks_per_dc"] * a["window"] * a["windows"] * a["layers"]  # fmt: skip
    return good


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dcs", type=int, default=1000)
    ap.add_argument("--ranks-per-dc", type=int, default=8)
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--window", type=int, default=10, help="steps per aggregation window")
    ap.add_argument("--windows", type=int, default=2, help="windows ingested per run")
    ap.add_argument("--rank-steps", type=int, default=1, help="steps of per-rank reports")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--dcs-per-message", type=int, default=10, help="DCs per message of a regional aggregator"
    )
    ap.add_argument("--no-grpc", action="store_true", help="core paths only")
    ap.add_argument("--only", default="", help="run only the paths whose name contains this")
    args = ap.parse_args(argv)
    a = {k: getattr(args, k) for k in
         ("dcs", "ranks_per_dc", "layers", "experts", "window", "windows", "rank_steps",
          "dcs_per_message")}  # fmt: skip
    load = os.getloadavg()
    print(f"ingestion: {a['dcs']} DCs x {a['ranks_per_dc']} ranks x {a['layers']} layers, "
          f"E={a['experts']}, aggregation window {a['window']} steps; each configuration in a "
          f"fresh process on one core; median of {args.repeats}; load average "
          f"{load[0]:.2f} at start")  # fmt: skip
    configs: list[tuple[str, Any, tuple[Any, ...], bool]] = [
        ("per-rank, core report_batch", _per_rank_core, (a, "batch"), False),
        ("per-rank, core report_load", _per_rank_core, (a, "load"), False),
        ("windows, core, L reports a DC", _windows_core, (a, "reports"), True),
        ("windows, core, a block a DC", _windows_core, (a, "block"), True),
    ]
    if not args.no_grpc:
        configs.insert(2, ("per-rank, gRPC ReportLoad", _over_grpc, (a, "rank"), False))
        configs.append(("windows, gRPC, L WindowReports", _over_grpc, (a, "window"), True))
        configs.append(("windows, gRPC, DcWindowReport int64", _over_grpc, (a, "block64"), True))
        configs.append(("windows, gRPC, DcWindowReport", _over_grpc, (a, "block"), True))
        configs.append(
            (
                f"windows, gRPC, {a['dcs_per_message']} DCs a message",
                _over_grpc,
                (a, "region"),
                True,
            )
        )
    configs = [c for c in configs if args.only in c[0]]
    print(f"{'path':<38}{'s/step':>9}{'CPU s/step':>12}{'vs per-rank':>13}{'peak RSS MB':>13}"
          f"{'sent':>9}{'rejected':>10}  reconciles")  # fmt: skip
    ok, base = True, None
    means: list[tuple[str, float]] = []
    for name, fn, fargs, windows in configs:
        runs = [_spawn(fn, *fargs) for _ in range(args.repeats)]
        wall = statistics.median(r["wall_per_step"] for r in runs)
        cpu = statistics.median(r["cpu_per_step"] for r in runs)
        rss = statistics.median(r["rss_mb"] for r in runs)
        base = base or wall
        good = all(_ok(r, a, windows) for r in runs)
        ok &= good
        if "means_seconds" in runs[0]:
            means.append((name, statistics.median(r["means_seconds"] for r in runs)))
        print(f"{name:<38}{wall:>9.3f}{cpu:>12.3f}{wall / base:>12.3f}x{rss:>13.0f}"
              f"{runs[-1]['sent']:>9}{runs[-1]['rejected']:>10}  {'yes' if good else 'NO'}")  # fmt: skip
    for name, sec in means:
        print(f"means on demand after {name!r}: {sec:.3f} s for the {a['layers']} layers' "
              f"[R, E] means of a window (once per window: {sec / a['window']:.3f} s/step)")  # fmt: skip
    agg = aggregator_cost(a)
    ok &= agg["exact"]
    print(f"one DC's aggregator (its own process, not the controller's): "
          f"{agg['seconds_per_step'] * 1e3:.1f} ms per step for {a['ranks_per_dc']} ranks x "
          f"{a['layers']} layers; output equals the numpy sums: {'yes' if agg['exact'] else 'NO'}")  # fmt: skip
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} at the end; nothing lost: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
