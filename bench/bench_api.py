"""Control-plane benchmark (`make bench-api`).

1. gRPC ingest: 1,000 simulated ranks, each holding its own ReportLoad stream, send
   one [E] load report per layer per step. The controller runs in this process; the
   ranks run in a separate process (asyncio, one stream per rank). Reports/s counts
   from the first report sent to the last accepted; counts must reconcile (sent ==
   accepted == received by the core, 0 rejected, every step complete). Baseline in
   the same run: `ControllerCore.report_load` called directly (no network).
2. REST "latest plan": an open-loop client in a separate process sends GET
   /api/v1/plans/latest at a fixed rate (500/s) on keep-alive connections; latency
   is measured from each request's scheduled time (no coordinated omission).
   Baseline in the same run: GET /api/v1/health at the same rate.

Prints a table; medians over --repeats runs. Targets: >= 20,000 reports/s, p99 < 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import numpy as np

from expertmesh.controller.core import ControllerCore, ControllerSettings
from expertmesh.controller.server import Surfaces
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.planner import ModelSpec, Topology


def _core(ranks: int, experts: int, layers: int, window: int) -> ControllerCore:
    topo = Topology.generate(dcs=4, ranks_per_dc=ranks // 4, masters=1, spare=1)
    model = ModelSpec(num_layers=layers, num_experts=experts, top_k=8)
    # The simulated ranks stream unsynchronized, up to the whole run apart (a real EP group
    # is lock-stepped by its all-to-all): keep every step pending so none is evicted.
    settings = ControllerSettings(window=window, max_pending_steps=max(16, window))
    return ControllerCore(topo, model, settings)


def _run_child(target: Any, args: tuple[Any, ...]) -> Any:
    """Run ``target(*args, queue)`` in a spawned process; return what it puts on the queue."""
    import queue

    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    try:
        while True:
            try:
                return q.get(timeout=1.0)
            except queue.Empty:
                if not p.is_alive():
                    raise RuntimeError(f"load generator exited with code {p.exitcode}") from None
    finally:
        p.join(30)


# ---- gRPC ingest ----


def _ranks_process(target: str, ranks: int, steps: int, layers: int, experts: int,
                   batch: int, out: Any) -> None:  # fmt: skip
    import grpc

    from expertmesh.v1 import expertmesh_pb2 as pb

    rng = np.random.default_rng(0)
    loads = rng.integers(0, 64, (ranks, experts)).tolist()
    # Serialize every message up front: the load generator should spend its CPU on sending.
    wire: list[list[bytes]] = []
    for r in range(ranks):
        msgs, buf = [], []
        for step in range(steps):
            for layer in range(layers):
                buf.append(pb.LoadReport(step=step, layer=layer, rank=r, load=loads[r]))
                if len(buf) == batch:
                    msgs.append(pb.ReportLoadRequest(reports=buf).SerializeToString())
                    buf = []
        if buf:
            msgs.append(pb.ReportLoadRequest(reports=buf).SerializeToString())
        wire.append(msgs)

    async def run() -> None:
        channels = [grpc.aio.insecure_channel(target) for _ in range(8)]
        for ch in channels:
            await ch.channel_ready()
        calls = [
            ch.stream_unary(
                "/expertmesh.v1.ExpertMeshService/ReportLoad",
                request_serializer=lambda b: b,
                response_deserializer=pb.ReportLoadResponse.FromString,
            )
            for ch in channels
        ]

        async def rank(r: int) -> int:
            resp = await calls[r % len(calls)](iter(wire[r]))
            return int(resp.accepted)

        t0 = time.perf_counter()
        accepted = await asyncio.gather(*(rank(r) for r in range(ranks)))
        seconds = time.perf_counter() - t0
        for ch in channels:
            await ch.close()
        out.put({"accepted": sum(accepted), "seconds": seconds})

    asyncio.run(run())


def bench_ingest(ranks: int, steps: int, layers: int, experts: int, batch: int) -> dict[str, Any]:
    core = _core(ranks, experts, layers, window=steps)
    with Surfaces(core, SurfaceSettings(rest_port=0, grpc_port=0)) as s:
        res = _run_child(_ranks_process, (s.grpc_target, ranks, steps, layers, experts, batch))
    sent = ranks * steps * layers
    complete = sum(core.window(layer).shape[0] for layer in range(layers))
    return {
        "sent": sent,
        "accepted": res["accepted"],
        "received": core.reports_received,
        "rejected": core.reports_rejected,
        "complete_steps": complete,
        "want_complete": steps * layers,
        "rate": sent / res["seconds"],
    }


def bench_direct(ranks: int, steps: int, layers: int, experts: int) -> float:
    core = _core(ranks, experts, layers, window=steps)
    loads = np.random.default_rng(0).integers(0, 64, (ranks, experts))
    t0 = time.perf_counter()
    for step in range(steps):
        for layer in range(layers):
            for r in range(ranks):
                core.report_load(step, layer, r, loads[r])
    return ranks * steps * layers / (time.perf_counter() - t0)


# ---- REST latency ----


class _Conn:
    """A minimal HTTP/1.1 keep-alive client (GET only): a load generator that spends its CPU
    on sending, not on a client library."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def get(self, host: str, path: str) -> tuple[int, bytes]:
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            if line.lower().startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        return status, await self.reader.readexactly(length)


def _rest_process(url: str, paths: list[str], rate: float, seconds: float, conns: int,
                  out: Any) -> None:  # fmt: skip
    host_port = url.split("//", 1)[1]
    host, port = host_port.rsplit(":", 1)

    async def run(path: str) -> dict[str, Any]:
        n = int(rate * seconds)
        lat: list[float] = []
        errors = 0
        pool: asyncio.Queue[_Conn] = asyncio.Queue()
        for _ in range(conns):
            pool.put_nowait(_Conn(*await asyncio.open_connection(host, int(port))))
        for _ in range(20):  # warm the connections and the plan cache
            c = await pool.get()
            await c.get(host_port, path)
            pool.put_nowait(c)
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            nonlocal errors
            when = t0 + i / rate
            await asyncio.sleep(max(0.0, when - time.perf_counter()))
            c = await pool.get()
            try:
                status, _ = await c.get(host_port, path)
            finally:
                pool.put_nowait(c)
            lat.append(time.perf_counter() - when)
            errors += status != 200

        await asyncio.gather(*(one(i) for i in range(n)))
        took = time.perf_counter() - t0
        while not pool.empty():
            pool.get_nowait().writer.close()
        arr = np.array(lat) * 1e3
        return {
            "n": n,
            "errors": errors,
            "p50": float(np.percentile(arr, 50)),
            "p99": float(np.percentile(arr, 99)),
            "max": float(arr.max()),
            "rate": n / took,
        }

    out.put({p: asyncio.run(run(p)) for p in paths})


def bench_rest(rate: float, seconds: float, conns: int) -> tuple[dict[str, Any], int]:
    topo = Topology.generate(dcs=2, ranks_per_dc=32, masters=4, spare=2)  # EP64
    model = ModelSpec(num_layers=4, num_experts=256, top_k=8)
    core = ControllerCore(topo, model, ControllerSettings())
    rng = np.random.default_rng(0)
    for layer in range(model.num_layers):
        core.report_layer(0, layer, rng.integers(0, 64, (64, 256)))
    core.commit(core.plan(0).version)
    with Surfaces(core, SurfaceSettings(rest_port=0, grpc_port=0)) as s:
        import httpx

        size = len(httpx.get(f"{s.rest_url}/api/v1/plans/latest").content)
        paths = ["/api/v1/health", "/api/v1/plans/latest"]
        res = _run_child(_rest_process, (s.rest_url, paths, rate, seconds, conns))
    return res, size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1, help="reports per gRPC message (1: none)")
    ap.add_argument("--rate", type=float, default=500.0, help="REST requests per second")
    ap.add_argument("--seconds", type=float, default=10.0, help="REST run length")
    ap.add_argument("--conns", type=int, default=32, help="REST keep-alive connections")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import os

    load1, load5, _ = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load1:.1f} (1 min) {load5:.1f} (5 min) "
          "at start; other work on the machine shares these cores")  # fmt: skip

    direct = statistics.median(
        bench_direct(args.ranks, args.steps, args.layers, args.experts) for _ in range(args.repeats)
    )
    runs = {
        b: [bench_ingest(args.ranks, args.steps, args.layers, args.experts, b)
            for _ in range(args.repeats)]
        for b in sorted({args.batch, 16})
    }  # fmt: skip
    print(f"gRPC ingest: {args.ranks} ranks x {args.steps} steps x {args.layers} layers, "
          f"E={args.experts}, one stream per rank; median of {args.repeats}")  # fmt: skip
    print(f"{'path':<34}{'reports/s':>12}{'vs direct':>11}{'sent':>9}{'accepted':>10}"
          f"{'rejected':>10}{'steps ok':>10}")  # fmt: skip
    print(f"{'core.report_load (no network)':<34}{direct:>12,.0f}{1.0:>10.2f}x")
    ok = True
    for b, rs in runs.items():
        rate = statistics.median(r["rate"] for r in rs)
        last = rs[-1]
        recon = all(
            r["sent"] == r["accepted"] == r["received"] and r["rejected"] == 0
            and r["complete_steps"] == r["want_complete"] for r in rs
        )  # fmt: skip
        ok &= recon
        print(f"{f'gRPC, {b} report(s)/message':<34}{rate:>12,.0f}{rate / direct:>10.2f}x"
              f"{last['sent']:>9}{last['accepted']:>10}{last['rejected']:>10}"
              f"{last['complete_steps']:>7}/{last['want_complete']}")  # fmt: skip
    print("counts reconcile: " + ("yes (sent == accepted == received, 0 rejected)" if ok else "NO"))

    rest: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        res, size = bench_rest(args.rate, args.seconds, args.conns)
        rest.append(res)
    print(f"\nREST at {args.rate:.0f} req/s open loop for {args.seconds:.0f} s, {args.conns} "
          f"keep-alive connections; latest plan = {size / 1024:.0f} KiB JSON "
          f"(EP64, 4 layers, 256 experts); median of {args.repeats}")  # fmt: skip
    print(f"{'endpoint':<26}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'req/s':>9}{'errors':>8}"
          f"{'p99 vs health':>15}")  # fmt: skip
    base_p99 = statistics.median(r["/api/v1/health"]["p99"] for r in rest)
    for path in ("/api/v1/health", "/api/v1/plans/latest"):
        med = {
            k: statistics.median(r[path][k] for r in rest) for k in ("p50", "p99", "max", "rate")
        }
        errors = sum(r[path]["errors"] for r in rest)
        print(f"{path:<26}{med['p50']:>9.2f}{med['p99']:>9.2f}{med['max']:>9.1f}"
              f"{med['rate']:>9.0f}{errors:>8}{med['p99'] / base_p99:>14.2f}x")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
