"""Soak benchmark (`make bench-soak`): 1,000 simulated ranks stream load reports over gRPC
to `expertmesh serve` for --minutes (default 10) while plans commit.

- The controller is `expertmesh serve` in a subprocess on free loopback ports (a topology
  of --dcs DCs and --ranks ranks, --layers MoE layers, policy --policy re-planned and
  committed every --every steps), with a bearer token.
- The ranks run in another process (asyncio): each rank holds one ReportLoad stream open
  for the whole soak and writes one message (its [E] load for every layer) per step, at
  --step-hz steps per second. Every --bad-every steps one hostile report (negative count,
  unknown rank, wrong length, stale step, in turn) goes on a short stream of its own and
  must be refused with INVALID_ARGUMENT.
- Baseline in the same run: before the ranks start, the same poller measures the same
  server idle for --baseline-seconds (plan 1, from step 0 sent over REST, is committed;
  no reports flow).
- Control in the same run: a do-nothing server of the same stack (uvicorn + FastAPI, a
  process of its own) answers GET /api/v1/plans/latest with the same bytes; a second
  poller polls it at the same rate during the baseline and the soak. Its tail is what the
  machine alone (other processes, this benchmark's own ranks and pollers) does to a
  request; the controller's tail beyond it is the controller's own.
- This process samples the controller's RSS (/proc/PID/status of the server and of its
  planner processes, summed; the server alone as well) every --sample-seconds and
  fits a least-squares line (MB/min, over the whole soak and after the first
  --warmup-minutes), and polls GET /api/v1/plans/latest at --rest-hz on one keep-alive
  connection (latency p50/p99/max; target p99 < 50 ms).
- Accounting at the end: client-side sent == server-side received; received = applied +
  rejected; applied == accepted by the streams == good reports sent; rejected == hostile
  reports sent; lost = good sent - accepted (must be 0).

    make bench-soak                       # 10 minutes
    python bench/bench_soak.py --minutes 1 [--ranks 1000] [--json out/soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ROOTS = [str(REPO / r) for r in ("controller", "workers", "proto")]
for _root in ROOTS:
    if _root not in sys.path:
        sys.path.insert(0, _root)

HOSTILE = ("negative", "unknown_rank", "short", "stale")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the controller's planner processes)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                kids = [int(x) for x in task.read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree_cpu(pid: int) -> dict[int, float]:
    """pid -> CPU seconds of ``pid`` and every process below it."""
    out = {}
    for p in [pid, *_descendants(pid)]:
        with contextlib.suppress(OSError, ValueError, IndexError):
            out[p] = _cpu_seconds(p)
    return out


def _tree_rss_mb(pid: int) -> tuple[float, float]:
    """(RSS of ``pid`` and every process below it, RSS of ``pid`` alone) in MB."""
    own = _rss_mb(pid)
    total = own
    for child in _descendants(pid):
        with contextlib.suppress(OSError, RuntimeError):  # exited meanwhile
            total += _rss_mb(child)
    return total, own


def slope_mb_per_min(samples: list[tuple[float, float]], after_s: float = 0.0) -> float | None:
    """Least-squares slope (MB per minute) of (seconds, MB) samples taken at or after
    ``after_s``; None with fewer than 3 samples."""
    pts = np.array([p for p in samples if p[0] >= after_s], dtype=float).reshape(-1, 2)
    if len(pts) < 3:
        return None
    slope, _ = np.polyfit(pts[:, 0] / 60.0, pts[:, 1], 1)
    return float(slope)


def floor_slope_mb_per_min(
    samples: list[tuple[float, float]], after_s: float = 0.0
) -> float | None:
    """Least-squares slope (MB per minute) of the per-minute minima of the samples taken at or
    after ``after_s``: the floor the controller returns to between plans, without the
    transient peaks of planning (a leak raises the floor)."""
    pts = np.array([p for p in samples if p[0] >= after_s], dtype=float).reshape(-1, 2)
    if not len(pts):
        return None
    minute = np.floor(pts[:, 0] / 60.0)
    floors = [(m, pts[minute == m, 1].min()) for m in np.unique(minute)]
    return slope_mb_per_min([(m * 60.0, v) for m, v in floors]) if len(floors) >= 3 else None


# ---- the ranks (a separate process) ----


def _ranks_process(target: str, token: str, cfg: dict[str, Any], out: Any) -> None:
    import grpc

    from expertmesh.v1 import expertmesh_pb2 as pb

    ranks, layers, experts = cfg["ranks"], cfg["layers"], cfg["experts"]
    rng = np.random.default_rng(0)
    # a few skewed loads reused in turn (Zipf-like popularity), as Python lists once
    pop = 1.0 / np.arange(1, experts + 1) ** 0.8
    variants = []
    for _ in range(4):
        p = rng.permutation(pop)
        p /= p.sum()
        loads = rng.multinomial(8 * 256, p, size=(layers, ranks))  # [L, R, E]
        variants.append(
            [[loads[layer, r].tolist() for r in range(ranks)] for layer in range(layers)]
        )
    metadata = (("authorization", f"Bearer {token}"),)

    async def run() -> dict[str, Any]:
        channels = [grpc.aio.insecure_channel(target) for _ in range(10)]
        for ch in channels:
            await asyncio.wait_for(ch.channel_ready(), 30)
        stubs = [
            ch.stream_unary(
                "/expertmesh.v1.ExpertMeshService/ReportLoad",
                request_serializer=pb.ReportLoadRequest.SerializeToString,
                response_deserializer=pb.ReportLoadResponse.FromString,
            )
            for ch in channels
        ]
        calls = [stubs[r % len(stubs)](metadata=metadata) for r in range(ranks)]
        good = bad = refused = 0
        lag: list[float] = []
        deadline = time.monotonic() + cfg["seconds"]
        t0 = time.monotonic()
        step = 1  # step 0 came whole over REST (the baseline needs a committed plan)
        while time.monotonic() < deadline:
            when = t0 + (step - 1) / cfg["step_hz"]
            now = time.monotonic()
            if when > now:
                await asyncio.sleep(when - now)
            lag.append(max(0.0, time.monotonic() - when))
            v = variants[step % len(variants)]
            writes = []
            for r in range(ranks):
                req = pb.ReportLoadRequest(
                    reports=[
                        pb.LoadReport(step=step, layer=layer, rank=r, load=v[layer][r])
                        for layer in range(layers)
                    ]
                )
                writes.append(calls[r].write(req))
            await asyncio.gather(*writes)
            good += ranks * layers
            if cfg["bad_every"] and step % cfg["bad_every"] == 1:
                kind = HOSTILE[(step // cfg["bad_every"]) % len(HOSTILE)]
                report = pb.LoadReport(step=step + 1, layer=0, rank=0, load=v[0][0])
                if kind == "negative":
                    report.load[0] = -1
                elif kind == "unknown_rank":
                    report.rank = ranks + 7
                elif kind == "short":
                    del report.load[1:]
                else:  # step 0, completed before the ranks started
                    report.step = 0
                bad += 1
                try:
                    await stubs[0](iter([pb.ReportLoadRequest(reports=[report])]),
                                   metadata=metadata, timeout=30)  # fmt: skip
                except grpc.aio.AioRpcError as err:
                    refused += err.code() == grpc.StatusCode.INVALID_ARGUMENT
            step += 1
        for c in calls:
            await c.done_writing()
        accepted = 0
        for c in calls:
            resp = await c
            accepted += int(resp.accepted)
        for ch in channels:
            await ch.close()
        return {
            "steps": step - 1,
            "good_sent": good,
            "accepted": accepted,
            "bad_sent": bad,
            "bad_refused": refused,
            "seconds": time.monotonic() - t0,
            "cpu_seconds": sum(os.times()[:2]),
            "step_lag_p99_s": float(np.percentile(lag, 99)) if lag else 0.0,
        }

    try:
        out.put(asyncio.run(run()))
    except BaseException as err:
        out.put({"error": f"{type(err).__name__}: {err}"})
        raise


# ---- this process: RSS and REST ----


class _Sampler(threading.Thread):
    def __init__(self, pid: int, every: float, t0: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.every, self.t0 = pid, every, t0
        self.samples: list[tuple[float, float]] = []  # (s, MB) server + planner processes
        self.own: list[tuple[float, float]] = []  # (s, MB) the server process alone
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                total, own = _tree_rss_mb(self.pid)
            except (OSError, RuntimeError):
                return
            at = time.monotonic() - self.t0
            self.samples.append((at, total))
            self.own.append((at, own))

            self.stop.wait(self.every)


class _RestPoller(threading.Thread):
    def __init__(self, url: str, hz: float) -> None:
        super().__init__(daemon=True)
        self.url, self.hz = url, hz
        self.lat_ms: list[float] = []
        self.slow: list[tuple[float, float]] = []  # (wall time, ms) of requests over 50 ms
        self.status: dict[int, int] = {}
        self.errors = 0
        self.stop = threading.Event()

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=10.0) as client:
            t0 = time.monotonic()
            i = 0
            while not self.stop.is_set():
                when = t0 + i / self.hz
                now = time.monotonic()
                if when > now:
                    self.stop.wait(when - now)
                i += 1
                start = time.perf_counter()
                try:
                    r = client.get(f"{self.url}/api/v1/plans/latest")
                    _ = r.content
                except httpx.HTTPError:
                    self.errors += 1
                    continue
                ms = (time.perf_counter() - start) * 1e3
                self.status[r.status_code] = self.status.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    self.lat_ms.append(ms)
                    if ms > 50:
                        self.slow.append((time.time(), ms))


def _control_server(sock: socket.socket, body: bytes) -> None:
    """The control: a server of the same stack (uvicorn + FastAPI, TCP_NODELAY) that answers
    GET /api/v1/plans/latest with fixed bytes and does nothing else (a separate process)."""
    import uvicorn
    from fastapi import FastAPI, Response

    app = FastAPI()

    @app.get("/api/v1/plans/latest")
    async def latest() -> Response:
        return Response(body, media_type="application/json")

    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])


def _start_control(body: bytes) -> tuple[Any, str]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    proc = mp.get_context("spawn").Process(target=_control_server, args=(sock, body), daemon=True)
    proc.start()
    sock.close()
    return proc, url


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"expertmesh serve exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/api/v1/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("expertmesh serve did not become ready")


def _prime(url: str, token: str, ranks: int, layers: int, experts: int) -> None:
    """Step 0 of every layer over REST (a whole [R, E] each), then wait for plan 1."""
    import httpx

    rng = np.random.default_rng(1)
    auth = {"Authorization": f"Bearer {token}"}
    for layer in range(layers):
        load = rng.integers(0, 16, (ranks, experts)).tolist()
        r = httpx.post(f"{url}/api/v1/reports/layer", json={"step": 0, "layer": layer,
                       "load": load}, headers=auth, timeout=60)  # fmt: skip
        r.raise_for_status()
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/api/v1/plans/latest", timeout=30).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the controller committed no plan for step 0")
        time.sleep(0.2)


def _latest_body(url: str) -> bytes:
    import httpx

    r = httpx.get(f"{url}/api/v1/plans/latest", timeout=30)
    r.raise_for_status()
    return r.content


def _wait_control(url: str, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/v1/plans/latest", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the control server did not start")


def _server_counts(url: str) -> dict[str, Any]:
    import httpx

    dash = httpx.get(f"{url}/api/v1/dashboard", timeout=30).json()
    plans = httpx.get(f"{url}/api/v1/plans", params={"limit": 1}, timeout=30).json()
    return {
        "received": int(dash["reports_received"]),
        "rejected": int(dash["reports_rejected"]),
        "plans_committed": int(plans["total"]),
        "plan_version": int(dash["plan_version"]),
    }


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    from expertmesh.formats import write_topology
    from expertmesh.planner import Topology

    if args.ranks % args.dcs:
        raise SystemExit("--ranks must be a multiple of --dcs")
    topo = Topology.generate(dcs=args.dcs, ranks_per_dc=args.ranks // args.dcs, masters=1, spare=1)
    experts = args.experts
    if not 1 <= experts <= topo.num_ranks:
        raise SystemExit("--experts must be in [1, --ranks] (one master slot per rank)")
    load_before = os.getloadavg()
    token = secrets.token_urlsafe(16)
    rest_port, grpc_port = _free_port(), _free_port()
    url = f"http://127.0.0.1:{rest_port}"
    with tempfile.TemporaryDirectory(prefix="expertmesh-soak-") as tmp:
        topo_path = Path(tmp) / "topology.yaml"
        write_topology(topo_path, topo)
        log_path = Path(args.log) if args.log else Path(tmp) / "serve.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(ROOTS), "EXPERTMESH_TOKEN": token}
        cmd = [
            sys.executable, "-m", "expertmesh.cli", "serve", "--topology", str(topo_path),
            "--layers", str(args.layers), "--experts", str(experts), "--policy", args.policy,
            "--trigger", "every_n", "--every", str(args.every),
            "--rest-port", str(rest_port), "--grpc-port", str(grpc_port),
            "--db", str(Path(tmp) / "plans.sqlite"),
            "--planner-process" if args.planner_process else "--no-planner-process",
        ]  # fmt: skip
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        control: Any = None
        try:
            _wait_ready(url, proc, 120)
            t0 = time.monotonic()
            sampler = _Sampler(proc.pid, args.sample_seconds, t0)
            sampler.start()
            _prime(url, token, topo.num_ranks, args.layers, experts)
            control, control_url = _start_control(_latest_body(url))
            _wait_control(control_url)
            poller = _RestPoller(url, args.rest_hz)
            ctl_poller = _RestPoller(control_url, args.rest_hz)
            poller.start()
            ctl_poller.start()
            time.sleep(args.baseline_seconds)  # the baseline: the same server, no ranks yet
            idle, ctl_idle = list(poller.lat_ms), list(ctl_poller.lat_ms)
            poller.lat_ms.clear()
            ctl_poller.lat_ms.clear()
            cfg = {
                "ranks": topo.num_ranks,
                "layers": args.layers,
                "experts": experts,
                "seconds": args.minutes * 60.0,
                "step_hz": args.step_hz,
                "bad_every": args.bad_every,
            }
            ctx = mp.get_context("spawn")
            q: Any = ctx.Queue()
            gen = ctx.Process(target=_ranks_process, args=(f"127.0.0.1:{grpc_port}", token, cfg, q))
            cpu_start, wall_start = _tree_cpu(proc.pid), time.monotonic()
            gen.start()
            client = q.get(timeout=args.minutes * 60.0 + 600)
            cpu_end, wall = _tree_cpu(proc.pid), time.monotonic() - wall_start
            gen.join(60)
            time.sleep(1.0)  # let the plan loop see the last step
            for t in (poller, ctl_poller, sampler):
                t.stop.set()
            for t in (poller, ctl_poller, sampler):
                t.join(15)
            if "error" in client:
                raise RuntimeError(f"load generator failed: {client['error']}")
            server = _server_counts(url)
            if proc.poll() is not None:
                raise RuntimeError(f"expertmesh serve died (code {proc.returncode})")
        finally:
            if control is not None and control.is_alive():
                control.terminate()
                control.join(10)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
    lat = np.array(poller.lat_ms or [float("nan")])
    base = np.array(idle or [float("nan")])
    ctl = np.array(ctl_poller.lat_ms or [float("nan")])
    ctl_base = np.array(ctl_idle or [float("nan")])
    samples, own = sampler.samples, sampler.own
    primed = args.layers  # the [R, E] step-0 reports over REST
    sent = client["good_sent"] + client["bad_sent"] + primed
    return {
        "config": {
            **cfg,
            "dcs": args.dcs,
            "policy": args.policy,
            "every": args.every,
            "minutes": args.minutes,
            "rest_hz": args.rest_hz,
            "planner_process": args.planner_process,
        },
        "client": client,
        "server": server,
        "accounting": {
            "client_sent": sent,
            "primed_over_rest": primed,
            "server_received": server["received"],
            "applied": server["received"] - server["rejected"],
            "rejected": server["rejected"],
            "lost": client["good_sent"] - client["accepted"],
            "lost_server_side": sent - server["received"],
            "reconciles": sent == server["received"]
            and server["received"] - server["rejected"] - primed
            == client["accepted"]
            == client["good_sent"]
            and server["rejected"] == client["bad_sent"] == client["bad_refused"],
        },
        "rss": {
            "first_mb": samples[0][1] if samples else None,
            "last_mb": samples[-1][1] if samples else None,
            "max_mb": max(s[1] for s in samples) if samples else None,
            "samples": len(samples),
            "slope_mb_per_min": slope_mb_per_min(samples),
            "slope_after_warmup_mb_per_min": slope_mb_per_min(samples, args.warmup_minutes * 60.0),
            "floor_slope_after_warmup_mb_per_min": floor_slope_mb_per_min(
                samples, args.warmup_minutes * 60.0
            ),
            "warmup_minutes": args.warmup_minutes,
            "series": samples,
            "server_only": {
                "first_mb": own[0][1] if own else None,
                "last_mb": own[-1][1] if own else None,
                "max_mb": max(s[1] for s in own) if own else None,
                "floor_slope_after_warmup_mb_per_min": floor_slope_mb_per_min(
                    own, args.warmup_minutes * 60.0
                ),
                "series": own,
            },
        },
        "rest_latest": {
            "requests_200": len(poller.lat_ms),
            "status": poller.status,
            "errors": poller.errors,
            "slow": poller.slow,
            "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)),
            "max_ms": float(lat.max()),
            "baseline_requests_200": len(idle),
            "baseline_p50_ms": float(np.percentile(base, 50)),
            "baseline_p99_ms": float(np.percentile(base, 99)),
        },
        # the same poller against a do-nothing server of the same stack, at the same time
        "control": {
            "requests_200": len(ctl_poller.lat_ms),
            "errors": ctl_poller.errors,
            "p50_ms": float(np.percentile(ctl, 50)),
            "p99_ms": float(np.percentile(ctl, 99)),
            "max_ms": float(ctl.max()),
            "over_50_ms": len(ctl_poller.slow),
            "baseline_p50_ms": float(np.percentile(ctl_base, 50)),
            "baseline_p99_ms": float(np.percentile(ctl_base, 99)),
        },
        "cpu": {
            "wall_seconds": wall,
            "server_cores": (cpu_end[proc.pid] - cpu_start.get(proc.pid, 0.0)) / wall,
            "planner_cores": sum(
                v - cpu_start.get(p, 0.0) for p, v in cpu_end.items() if p != proc.pid
            )
            / wall,
        },
        "loadavg_before": load_before,
        "loadavg": os.getloadavg(),
        "cpus": os.cpu_count(),
    }


def _report(res: dict[str, Any]) -> str:
    c, s, a, m, r = res["client"], res["server"], res["accounting"], res["rss"], res["rest_latest"]
    o, k = m["server_only"], res["control"]
    cfg = res["config"]

    def f(x: float | None, fmt: str = ".2f") -> str:
        return "n/a" if x is None else format(x, fmt)

    rows = [
        ("duration", f"{c['seconds'] / 60:.2f} min, {c['steps']} steps at {cfg['step_hz']}/s"),
        ("ranks x layers x experts", f"{cfg['ranks']} x {cfg['layers']} x {cfg['experts']}"),
        ("plans committed", f"{s['plans_committed']} ({cfg['policy']}, every {cfg['every']} steps)"),
        ("reports sent (client)", f"{a['client_sent']} ({c['good_sent']} good, {c['bad_sent']} hostile, {a['primed_over_rest']} [R, E] over REST)"),
        ("reports received (server)", str(a["server_received"])),
        ("applied + rejected", f"{a['applied']} + {a['rejected']}"),
        ("accepted by the streams", str(c["accepted"])),
        ("hostile refused (INVALID_ARGUMENT)", str(c["bad_refused"])),
        ("reports lost", str(a["lost"])),
        ("accounting reconciles", str(a["reconciles"])),
        ("planner", "separate process" if cfg["planner_process"] else "in the server process"),
        ("controller RSS first / last / max MB (server + planner)", f"{f(m['first_mb'], '.1f')} / {f(m['last_mb'], '.1f')} / {f(m['max_mb'], '.1f')}"),
        ("server process alone: RSS first / last / max MB", f"{f(o['first_mb'], '.1f')} / {f(o['last_mb'], '.1f')} / {f(o['max_mb'], '.1f')}"),
        ("RSS slope, whole soak (MB/min)", f(m["slope_mb_per_min"], ".3f")),
        (f"RSS slope after {m['warmup_minutes']} min (MB/min)", f(m["slope_after_warmup_mb_per_min"], ".3f")),
        ("slope of the per-minute RSS floor after warm-up (MB/min)", f(m["floor_slope_after_warmup_mb_per_min"], ".3f")),
        ("the same, server process alone (MB/min)", f(o["floor_slope_after_warmup_mb_per_min"], ".3f")),
        ("GET /plans/latest p50 / p99 / max ms", f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f} / {r['max_ms']:.1f} ({r['requests_200']} requests)"),
        ("p99 < 50 ms", str(r["p99_ms"] < 50.0)),
        ("requests over 50 ms", f"{len(r['slow'])} ({100 * len(r['slow']) / max(1, r['requests_200']):.1f}%)"),
        ("baseline (no ranks) p50 / p99 ms", f"{r['baseline_p50_ms']:.1f} / {r['baseline_p99_ms']:.1f} ({r['baseline_requests_200']} requests)"),
        ("p99 under soak / baseline p99", f"{r['p99_ms'] / r['baseline_p99_ms']:.1f}x"),
        ("control server (same stack, no work), same time: p50 / p99 / max ms", f"{k['p50_ms']:.1f} / {k['p99_ms']:.1f} / {k['max_ms']:.1f} ({k['requests_200']} requests, {k['over_50_ms']} over 50 ms)"),
        ("control server during the baseline: p50 / p99 ms", f"{k['baseline_p50_ms']:.1f} / {k['baseline_p99_ms']:.1f}"),
        ("p99 / control p99 (same time)", f"{r['p99_ms'] / k['p99_ms']:.1f}x"),
        ("step lag p99 (s)", f"{c['step_lag_p99_s']:.3f}"),
        ("CPU while the ranks stream: server / planner / ranks processes (cores)", f"{res['cpu']['server_cores']:.2f} / {res['cpu']['planner_cores']:.2f} / {c['cpu_seconds'] / c['seconds']:.2f}"),
        ("load average (1, 5, 15 min) before", ", ".join(f"{x:.2f}" for x in res["loadavg_before"])),
        ("load average (1, 5, 15 min) at the end", ", ".join(f"{x:.2f}" for x in res["loadavg"])),
    ]  # fmt: skip
    out = ["| soak | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the ranks stream")
    ap.add_argument("--ranks", type=int, default=1000)
    ap.add_argument("--dcs", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=256, help="experts per layer (<= ranks)")
    ap.add_argument("--step-hz", type=float, default=1.0, help="steps per second")
    ap.add_argument("--policy", default="eplb")
    ap.add_argument("--every", type=int, default=10, help="plan and commit every N steps")
    ap.add_argument("--bad-every", type=int, default=5, help="one hostile report per N steps")
    ap.add_argument("--rest-hz", type=float, default=20.0, help="GET /plans/latest per second")
    ap.add_argument(
        "--baseline-seconds", type=float, default=30.0, help="REST polled before the ranks start"
    )
    ap.add_argument("--sample-seconds", type=float, default=5.0, help="RSS sampling period")
    ap.add_argument("--warmup-minutes", type=float, default=2.0)
    ap.add_argument(
        "--planner-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the controller plans in a separate process (serve's default); "
        "--no-planner-process plans in the server process",
    )
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    ap.add_argument("--log", default=None, help="keep the controller's log here")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.step_hz <= 0 or args.rest_hz <= 0:
        ap.error("--minutes, --step-hz and --rest-hz must be > 0")
    args.warmup_minutes = min(args.warmup_minutes, args.minutes / 2)
    res = run_soak(args)
    print(_report(res))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
    ok = res["accounting"]["reconciles"] and res["accounting"]["lost"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
