"""The gRPC service ``expertmesh.v1.ExpertMeshService`` over a :class:`ControllerCore`.

An asyncio server (``grpc.aio``) in a thread of its own, so a thousand ranks
may each hold a report stream open without a thread apiece. Messages become
domain types at the edge (``expertmesh.v1.convert``); bad input ends the call
with ``INVALID_ARGUMENT`` (``RESOURCE_EXHAUSTED`` for too many reports in one
message), counted as rejected, and the core is left as it was; so do bytes that are
not a valid message (:mod:`expertmesh.controller.grpc_guard`). Standard health checking
(``grpc.health.v1``) and server reflection (``grpc.reflection.v1alpha``, so grpcurl needs
no ``-proto``) are served alongside.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from expertmesh.controller.auth import token_matches
from expertmesh.controller.core import BatchReportError, ControllerCore, PlanVersion
from expertmesh.controller.grpc_guard import UndecodableRequests
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.controller.store import SqlitePlanStore
from expertmesh.v1 import convert
from expertmesh.v1 import expertmesh_pb2 as pb
from expertmesh.v1 import expertmesh_pb2_grpc as pb_grpc

__all__ = ["SERVICE_NAME", "GrpcServer"]

log = logging.getLogger(__name__)

SERVICE_NAME = "expertmesh.v1.ExpertMeshService"
MAX_REPORTS_PER_MESSAGE = 4096
WATCH_QUEUE = 4  # a slow watcher skips to newer plans rather than buffering them all


class _PlanHub:
    """Fans committed plans out to WatchPlans calls (listener thread -> server loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queues: set[asyncio.Queue[PlanVersion]] = set()

    def subscribe(self) -> asyncio.Queue[PlanVersion]:
        q: asyncio.Queue[PlanVersion] = asyncio.Queue(maxsize=WATCH_QUEUE)
        self._queues.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[PlanVersion]) -> None:
        self._queues.discard(q)

    def on_plan(self, event: str, pv: PlanVersion) -> None:
        if event == "committed" and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._publish, pv)

    def _publish(self, pv: PlanVersion) -> None:
        for q in list(self._queues):
            if q.full():
                q.get_nowait()  # drop the oldest: only the newest plan matters
            q.put_nowait(pv)


class ExpertMeshService(pb_grpc.ExpertMeshServiceServicer):
    def __init__(
        self,
        core: ControllerCore,
        store: SqlitePlanStore | None,
        settings: SurfaceSettings,
        hub: _PlanHub,
    ) -> None:
        self.core, self.store, self.settings, self.hub = core, store, settings, hub

    def _authorized(self, context: grpc.aio.ServicerContext) -> bool:
        want = self.settings.token_value()
        if want is None:
            return True
        got = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                got = value
        return token_matches(got, want)  # the rule REST applies too (scheme case-insensitive)

    async def ReportLoad(
        self, request_iterator: AsyncIterator[pb.ReportLoadRequest], context: Any
    ) -> pb.ReportLoadResponse:
        core = self.core
        authorized = self._authorized(context)
        accepted = completed = 0
        async for req in request_iterator:
            n = len(req.reports)
            if not authorized:
                core.reject_report(n)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
            if n > MAX_REPORTS_PER_MESSAGE:
                core.reject_report(n)
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"a message may hold at most {MAX_REPORTS_PER_MESSAGE} reports, got {n}",
                )
            batch = convert.report_batch_from_msg(req, core.model.num_experts)
            if batch is not None:  # the fast path: one lock, vectorized checks
                try:
                    applied, done = core.report_batch(*batch)
                except BatchReportError as err:
                    i = err.applied
                    r = req.reports[i]
                    text = f"report {i} (step {r.step}, layer {r.layer}, rank {r.rank}): {err}"
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, text)
                accepted += applied
                completed += done
                continue
            for i, msg in enumerate(req.reports):
                try:
                    rep = convert.report_from_msg(msg)
                except ValueError as err:
                    core.reject_report(n - i)  # this one and the rest of the message
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
                try:
                    one = core.report_load(rep.step, rep.layer, rep.rank, rep.load)
                except ValueError as err:  # the core counted this one
                    core.reject_report(n - i - 1)  # and the rest of the message is refused too
                    text = (
                        f"report {i} (step {rep.step}, layer {rep.layer}, rank {rep.rank}): {err}"
                    )
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, text)
                accepted += 1
                completed += int(one)
        return pb.ReportLoadResponse(accepted=accepted, completed=completed)

    async def ReportWindows(
        self, request: pb.ReportWindowsRequest, context: Any
    ) -> pb.ReportWindowsResponse:
        core = self.core
        n = convert.window_count(request)  # a block counts as its layers
        if not self._authorized(context):
            core.reject_report(n, windows=True)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
        if n > MAX_REPORTS_PER_MESSAGE:
            core.reject_report(n, windows=True)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"a message may hold at most {MAX_REPORTS_PER_MESSAGE} reports, got {n}",
            )
        items, bad = convert.windows_from_msg(request, core.model.num_experts)
        decoded = sum(len(x) if isinstance(x, convert.WindowBlock) else 1 for x in items)
        try:
            # a completed window builds an [R, E] load: off the event loop
            applied, done = await asyncio.to_thread(core.report_windows, items)
        except BatchReportError as err:
            if bad is not None:
                core.reject_report(n - decoded, windows=True)  # the undecodable rest
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, _window_error(request, items, err)
            )
        if bad is not None:
            core.reject_report(n - decoded, windows=True)  # this one and the rest
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"window report {bad[0]}: {bad[1]}"
            )
        return pb.ReportWindowsResponse(accepted=applied, completed=done)

    async def WatchPlans(
        self, request: pb.WatchPlansRequest, context: Any
    ) -> AsyncIterator[pb.WatchPlansResponse]:
        q = self.hub.subscribe()  # before reading the committed plan: none is missed
        try:
            last = 0
            current = self.core.committed
            if current is not None:
                yield pb.WatchPlansResponse(
                    plan=convert.plan_to_msg(current, include_route=request.include_route)
                )
                last = current.version
            while True:
                pv = await q.get()
                if pv.version <= last:
                    continue
                last = pv.version
                yield pb.WatchPlansResponse(
                    plan=convert.plan_to_msg(pv, include_route=request.include_route)
                )
        finally:
            self.hub.unsubscribe(q)

    async def GetPlan(self, request: pb.GetPlanRequest, context: Any) -> pb.GetPlanResponse:
        pv: PlanVersion | None
        if request.version == 0:
            pv = self.core.committed
            if pv is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, "no plan has been committed yet")
        else:
            try:
                pv = self.core.get(request.version)
            except ValueError:
                pv = self.store.get(request.version) if self.store is not None else None
            if pv is None:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND, f"unknown plan version {request.version}"
                )
        if pv is None:  # abort() raised already; this only narrows the type
            raise RuntimeError("unreachable")
        return pb.GetPlanResponse(plan=convert.plan_to_msg(pv, include_route=request.include_route))

    async def Solve(self, request: pb.SolveRequest, context: Any) -> pb.SolveResponse:
        try:
            args = convert.solve_args_from_msg(request)
            lp, before, after = await asyncio.to_thread(
                self.core.what_if,
                args.load,
                layer=args.layer,
                policy=args.policy,
                policy_settings=args.policy_settings,
                from_committed=args.from_committed,
            )
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return pb.SolveResponse(
            policy=args.policy or self.core.settings.policy,
            imbalance_before=before,
            imbalance_after=after,
            plan=convert.layer_plan_to_msg(args.layer, lp, include_route=True),
        )


def _window_error(request: pb.ReportWindowsRequest, items: list[Any], err: BatchReportError) -> str:
    """Names the item (report or block) whose layers ``err.applied`` reached."""
    at = 0
    for i, item in enumerate(items):
        size = len(item) if isinstance(item, convert.WindowBlock) else 1
        if err.applied < at + size:
            if i < len(request.reports):
                r = request.reports[i]
                return (
                    f"window report {i} (layer {r.layer}, DC {r.dc}, steps "
                    f"{r.first_step}..{r.last_step}): {err}"
                )
            b = request.dc_windows[i - len(request.reports)]
            return f"window block {i} (DC {b.dc}, steps {b.first_step}..{b.last_step}): {err}"
        at += size
    return str(err)


def server_credentials(settings: SurfaceSettings) -> grpc.ServerCredentials | None:
    """TLS credentials of the gRPC port (None: plaintext). With ``tls_client_ca`` every
    client must present a certificate signed by it (mutual TLS)."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    ca = settings.tls_client_ca.read_bytes() if settings.tls_client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(settings.tls_key.read_bytes(), settings.tls_cert.read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


class GrpcServer:
    """Runs the service on its own event loop in a daemon thread. ``start`` returns the port."""

    def __init__(
        self,
        core: ControllerCore,
        store: SqlitePlanStore | None = None,
        settings: SurfaceSettings | None = None,
    ) -> None:
        self.core, self.store = core, store
        self.settings = settings or SurfaceSettings()
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._thread: threading.Thread | None = None
        self._hub: _PlanHub | None = None
        self._health: Any = None

    @property
    def serving(self) -> bool:
        return self._server is not None and self._thread is not None and self._thread.is_alive()

    def start(self, host: str | None = None, port: int | None = None) -> int:
        if self._thread is not None:
            raise RuntimeError("the gRPC server is already running")
        host = self.settings.host if host is None else host
        port = self.settings.grpc_port if port is None else port
        ready = threading.Event()
        failure: list[BaseException] = []
        loop = asyncio.new_event_loop()
        self._loop = loop

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._serve(host, port))
            except BaseException as err:
                failure.append(err)
            finally:
                ready.set()
            if not failure:
                loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="expertmesh-grpc", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failure:
            self._thread.join(5)
            self._thread = None
            raise RuntimeError(f"gRPC server did not start on {host}:{port}: {failure[0]}")
        if self.port is None:
            raise RuntimeError("gRPC server did not report its port in time")
        return self.port

    async def _serve(self, host: str, port: int) -> None:
        size = self.settings.max_message_bytes
        core = self.core

        def refused(method: str) -> None:  # an undecodable report message counts as rejected
            if method == f"/{SERVICE_NAME}/ReportLoad":
                core.reject_report()
            elif method == f"/{SERVICE_NAME}/ReportWindows":
                core.reject_report(windows=True)

        server = grpc.aio.server(
            interceptors=[UndecodableRequests(refused)],
            # beyond this many open calls (report streams, plan watchers) new ones get
            # RESOURCE_EXHAUSTED instead of memory
            maximum_concurrent_rpcs=self.settings.max_concurrent_rpcs,
            options=[
                ("grpc.max_receive_message_length", size),
                ("grpc.max_send_message_length", size),
                ("grpc.so_reuseport", 0),
            ],
        )
        loop = asyncio.get_running_loop()
        self._hub = _PlanHub(loop)
        self.core.listeners.append(self._hub.on_plan)
        pb_grpc.add_ExpertMeshServiceServicer_to_server(
            ExpertMeshService(self.core, self.store, self.settings, self._hub), server
        )
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        creds = server_credentials(self.settings)
        if creds is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", creds)
        if bound == 0:
            raise OSError(f"cannot bind {host}:{port}")
        await server.start()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server, self.port = server, bound
        log.info("gRPC serving on %s:%d", host, bound)

    def stop(self, grace: float = 1.0) -> None:
        loop, server, thread = self._loop, self._server, self._thread
        if loop is None or thread is None:
            return
        if self._hub is not None and self._hub.on_plan in self.core.listeners:
            self.core.listeners.remove(self._hub.on_plan)

        async def shutdown() -> None:
            if self._health is not None:
                await self._health.enter_graceful_shutdown()
            if server is not None:
                await server.stop(grace)

        if not loop.is_closed() and loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(shutdown(), loop)
            try:
                fut.result(grace + 5)
            except Exception:
                log.exception("gRPC shutdown failed")
            loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        self._thread = self._server = self._loop = None
