"""Surfaces: the REST app (uvicorn, in a thread) and the gRPC server around one core.

Both ``expertmesh serve`` and the runtime's Ray controller actor host the same
:class:`Surfaces`: build a :class:`ControllerCore`, hand it here, ``start()``;
``stop()`` shuts both down. Ports 0 pick free ones (tests); the bound ports are
in :attr:`Surfaces.rest_port` and :attr:`Surfaces.grpc_port`.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from typing import Any

import uvicorn

from expertmesh.controller.api import create_app
from expertmesh.controller.core import ControllerCore
from expertmesh.controller.grpc_service import GrpcServer
from expertmesh.controller.settings import SurfaceSettings, is_loopback
from expertmesh.controller.store import SqlitePlanStore
from expertmesh.controller.telemetry import Telemetry

__all__ = ["Surfaces"]

log = logging.getLogger(__name__)

# Committed plans an in-memory plan store keeps (a plan holds ~R * E route rows per layer).
MEMORY_RETENTION = 16


class _Uvicorn(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # the host process owns signals
        pass


def _uvicorn_tls(settings: SurfaceSettings) -> dict[str, Any]:
    """uvicorn's TLS settings: the certificate and key; with a client CA, a client
    certificate signed by it is required (the handshake fails without one)."""
    if not settings.tls:
        return {}
    out: dict[str, Any] = {
        "ssl_certfile": str(settings.tls_cert),
        "ssl_keyfile": str(settings.tls_key),
    }
    if settings.tls_client_ca is not None:
        out["ssl_ca_certs"] = str(settings.tls_client_ca)
        out["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    return out


class Surfaces:
    """REST + dashboard + ``/metrics`` and gRPC over ``core``.

    ``store``: where committed plans persist. When None and the core already saves its
    commits to a :class:`SqlitePlanStore` (the runtime's controller actor attaches its own),
    that store is used: the plan list must read the store the commits go to. Otherwise one
    is opened at ``settings.db_path`` and the core's newest committed plan and settings are
    recovered from it (pass ``recover=False`` to skip), and attached to the core (``core``
    saves every commit to it).
    """

    def __init__(
        self,
        core: ControllerCore,
        settings: SurfaceSettings | None = None,
        *,
        store: SqlitePlanStore | None = None,
        telemetry: Telemetry | None = None,
        recover: bool = True,
    ) -> None:
        self.settings = settings or SurfaceSettings()
        if not is_loopback(self.settings.host) and self.settings.token_value() is None:
            raise ValueError(
                f"refusing to bind {self.settings.host} without a token: set EXPERTMESH_TOKEN "
                "or bind 127.0.0.1"
            )
        self.core = core
        if store is None and isinstance(core.store, SqlitePlanStore):
            store = core.store  # the host (the runtime's actor) owns it and recovered from it
        self._own_store = store is None
        keep = self.settings.plan_retention
        if self.settings.db_path == ":memory:":  # the plans would live in this process's RAM
            keep = min(keep, MEMORY_RETENTION)
        self.store = store or SqlitePlanStore(self.settings.db_path, keep=keep)
        if core.store is None:
            core.attach_store(self.store)
        if recover and self._own_store:
            pv = self.store.recover(core)
            if pv is not None:
                log.info("recovered plan %d from %s", pv.version, self.settings.db_path)
        self._own_telemetry = telemetry is None
        self.telemetry = telemetry or Telemetry(core)
        self.grpc = GrpcServer(core, self.store, self.settings)
        self.app = create_app(
            core,
            self.telemetry,
            self.store,
            self.settings,
            ready_checks={"grpc": lambda: self.grpc.serving, "rest": self._rest_up},
        )
        self.rest_port: int | None = None
        self.grpc_port: int | None = None
        self._uvicorn: _Uvicorn | None = None
        self._rest_thread: threading.Thread | None = None

    def _rest_up(self) -> bool:
        return self._uvicorn is not None and bool(self._uvicorn.started)

    @property
    def rest_url(self) -> str:
        host = self.settings.host
        host = f"[{host}]" if ":" in host else host
        return f"{self.settings.scheme}://{host}:{self.rest_port}"

    @property
    def grpc_target(self) -> str:
        return f"{self.settings.host}:{self.grpc_port}"

    def start(self, timeout: float = 30.0) -> Surfaces:
        """Start gRPC, then REST; returns self once both accept connections."""
        self.grpc_port = self.grpc.start()
        try:
            self._start_rest(timeout)
        except BaseException:
            self.grpc.stop()
            raise
        log.info("REST on %s, gRPC on %s", self.rest_url, self.grpc_target)
        return self

    def _start_rest(self, timeout: float) -> None:
        host, port = self.settings.host, self.settings.rest_port
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted sockets inherit TCP_NODELAY: without it a response written as headers +
        # body waits for the client's delayed ACK (~40 ms per request on keep-alive).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))  # bind here so port 0 resolves and errors surface now
        self.rest_port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=30,
            limit_concurrency=1024,
            backlog=2048,
            h11_max_incomplete_event_size=64 * 1024,
            **_uvicorn_tls(self.settings),
        )
        server = _Uvicorn(config)
        self._uvicorn = server
        self._rest_thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="expertmesh-rest", daemon=True
        )
        self._rest_thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._rest_thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"REST server did not start on {host}:{self.rest_port}")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._rest_thread is not None:
            self._rest_thread.join(10)
        self._uvicorn = self._rest_thread = None
        self.grpc.stop()
        if self._own_telemetry:
            self.telemetry.close()
        if self._own_store:
            if self.core.store is self.store:  # a later host must not adopt a closed store
                self.core.attach_store(None)
            self.store.close()

    def __enter__(self) -> Surfaces:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
