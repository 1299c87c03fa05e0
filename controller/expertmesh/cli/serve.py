"""``expertmesh serve``: the controller with REST, gRPC, ``/metrics`` and the dashboard.

For trainers outside Ray: they report load and receive plans over gRPC; no Ray
workers are started. Binds 127.0.0.1 on port 8700 (REST, dashboard, metrics)
and 8701 (gRPC) unless told otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from expertmesh.cli.common import json_object
from expertmesh.cli.main import UsageError

DEFAULT_TOPOLOGY = Path(__file__).resolve().parents[3] / "deploy" / "topologies" / "two-dc.yaml"


def add_parser(sub: Any) -> None:
    from expertmesh.controller.settings import DEFAULT_GRPC_PORT, DEFAULT_REST_PORT

    p = sub.add_parser(
        "serve",
        help="run the controller with REST, gRPC, /metrics and the dashboard",
        description=(
            "Run the controller for trainers outside Ray: REST + dashboard + /metrics on "
            f"--rest-port (default {DEFAULT_REST_PORT}), gRPC on --grpc-port (default "
            f"{DEFAULT_GRPC_PORT}), both on --host (default 127.0.0.1). Plans are planned "
            "from the reported load on the trigger and committed at once (no weights move "
            "here: external trainers apply the plans they receive)."
        ),
    )
    p.add_argument("--topology", type=Path, default=None, help="topology YAML")
    p.add_argument("--policy", default=None, help="policy name (default: stored or static)")
    p.add_argument("--policy-settings", default=None, help="policy settings as a JSON object")
    p.add_argument("--layers", type=int, default=2, help="MoE layers of the model")
    p.add_argument("--experts", type=int, default=None, help="experts per layer")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn-hidden", type=int, default=2048)
    p.add_argument("--trigger", choices=["every_step", "every_n", "threshold"], default="every_n")
    p.add_argument("--every", type=int, default=10, help="steps between plans (every_n)")
    p.add_argument("--threshold", type=float, default=1.2, help="imbalance that triggers")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--rest-port", type=int, default=None)
    p.add_argument("--grpc-port", type=int, default=None)
    p.add_argument(
        "--token", default=None, help="bearer token for writes (default: $EXPERTMESH_TOKEN)"
    )
    p.add_argument(
        "--db", default=None, help="SQLite plan store (default: in memory, newest 16 plans)"
    )
    p.add_argument("--retention", type=int, default=None, help="committed plans kept")
    p.add_argument(
        "--tls-cert",
        type=Path,
        default=None,
        help="PEM certificate: REST, the dashboard and gRPC speak only TLS (with --tls-key; "
        "default $EXPERTMESH_TLS_CERT)",
    )
    p.add_argument("--tls-key", type=Path, default=None, help="PEM key of --tls-cert")
    p.add_argument(
        "--tls-client-ca",
        type=Path,
        default=None,
        help="PEM CA: clients must present a certificate it signed (mutual TLS)",
    )
    p.add_argument("--seconds", type=float, default=None, help="stop after this long")
    p.add_argument(
        "--planner-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compute plans in a separate, lower-priority process, so a long plan does not "
        "slow REST and gRPC (default: on)",
    )
    p.add_argument("--plan-workers", type=int, default=1, help="planner processes")
    p.set_defaults(func=run)


def _settings_from(args: argparse.Namespace) -> Any:
    from pydantic import ValidationError

    from expertmesh.controller.settings import SurfaceSettings

    given = {
        "host": args.host,
        "rest_port": args.rest_port,
        "grpc_port": args.grpc_port,
        "token": args.token,
        "db_path": args.db,
        "plan_retention": args.retention,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_client_ca": args.tls_client_ca,
    }
    try:
        return SurfaceSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(map(str, e["loc"]))
        raise UsageError(f"{where}: {e['msg']}" if where else str(e["msg"])) from None


def build_core(args: argparse.Namespace) -> Any:
    from pydantic import ValidationError

    from expertmesh.controller.core import (
        ControllerCore,
        ControllerSettings,
        PlannerSettings,
        Trigger,
    )
    from expertmesh.formats import read_topology
    from expertmesh.planner import ModelSpec

    topo = read_topology(args.topology or DEFAULT_TOPOLOGY)
    experts = args.experts or topo.num_ranks * topo.masters_per_rank
    model = ModelSpec(
        num_layers=args.layers,
        num_experts=experts,
        top_k=args.top_k,
        hidden=args.hidden,
        ffn_hidden=args.ffn_hidden,
    )
    settings_json = json_object(args.policy_settings, "--policy-settings")
    trigger = Trigger(mode=args.trigger, every=args.every, threshold=args.threshold)
    settings = ControllerSettings(
        policy=args.policy or "static", policy_settings=settings_json, trigger=trigger
    )
    try:
        planner = PlannerSettings(process=args.planner_process, workers=args.plan_workers)
    except ValidationError as err:
        e = err.errors()[0]
        raise UsageError(f"--plan-workers: {e['msg']}") from None
    return ControllerCore(topo, model, settings, planner=planner)


def run(args: argparse.Namespace) -> int:
    from expertmesh.controller.server import Surfaces

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    settings = _settings_from(args)
    core = build_core(args)
    explicit = core.settings
    surfaces = Surfaces(core, settings)
    if args.policy is not None and core.settings != explicit:
        core.configure(explicit)  # the command line wins over stored settings
    surfaces.store.save_settings(core.settings)
    loop = PlanLoop(core)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    surfaces.start()
    big_buffers_to_mmap()
    settle_heap()
    try:
        topo = core.topology
        print(
            f"expertmesh serve: {topo.num_dcs} DCs, {topo.num_ranks} ranks, "
            f"{core.model.num_layers} layers x {core.model.num_experts} experts, "
            f"policy {core.settings.policy}"
        )
        print(f"  dashboard  {surfaces.rest_url}/")
        print(f"  REST       {surfaces.rest_url}/api/v1  (OpenAPI {surfaces.rest_url}/docs)")
        print(f"  metrics    {surfaces.rest_url}/metrics")
        print(f"  gRPC       {surfaces.grpc_target}  (expertmesh.v1.ExpertMeshService)")
        planner = core.planner_settings
        where = f"{planner.workers} process(es), nice +{planner.nice}"
        print(f"  planner    {where if planner.process else 'in this process'}")
        if settings.tls:
            mutual = ", client certificates required" if settings.tls_client_ca else ""
            print(f"  TLS        REST, dashboard and gRPC ({settings.tls_cert}{mutual})")
        if settings.token_value() is None:
            print("  writes     policy changes refused (no token); reports open on loopback")
        else:
            print("  writes     need 'Authorization: Bearer <token>'")
        deadline = None if args.seconds is None else time.monotonic() + args.seconds
        while not stop.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            loop.tick()
            stop.wait(0.05)
    except KeyboardInterrupt:
        pass
    finally:
        surfaces.stop()
        core.close()
    return 0


def big_buffers_to_mmap(threshold: int = 1 << 20) -> bool:
    """Serve allocations of ``threshold`` bytes and more (a plan's arrays: ~10 MB at 1,000
    ranks x 256 experts, every commit) from their own mmap, returned to the OS when freed.
    glibc's default threshold rises after the first such buffer is freed, and later ones
    then come from the heap, which cannot shrink past live objects above them. False
    where the C library is not glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, threshold))  # -3: M_MMAP_THRESHOLD (fixes it)
    except (OSError, AttributeError):
        return False


def settle_heap() -> None:
    """Move every object alive now (modules, the app, the core) out of the cyclic garbage
    collector's reach: a full collection then scans only what was made since. Without it,
    each full collection walked ~170k objects (~70 ms holding the interpreter, every ~40 s
    under the soak's load) and stalled the REST thread. Objects made later are collected
    as usual; reference counting still frees frozen ones."""
    gc.collect()
    gc.freeze()


class PlanLoop:
    """The serve-mode control loop: when a step's load is complete for every layer, ask the
    trigger; plan and commit at once (external trainers apply what they receive)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self._seen: int | None = None
        self.log = logging.getLogger("expertmesh.serve")

    def tick(self) -> None:
        core = self.core
        try:
            steps = [core.layer_newest_step(i) for i in range(core.model.num_layers)]
            if any(s is None for s in steps):
                return
            step = min(steps)
            if self._seen is not None and step <= self._seen:
                return
            self._seen = step
            pv = core.maybe_plan(step)
            if pv is not None:
                core.commit(pv.version)
                self.log.info(
                    "plan %d at step %d: imbalance %.3f -> %.3f",
                    pv.version,
                    step,
                    max(pv.imbalance_before),
                    max(pv.imbalance_after),
                )
        except Exception:  # the control loop never dies
            self.log.exception("control loop tick failed")
