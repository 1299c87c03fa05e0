"""The FastAPI app: REST under ``/api/v1``, ``/metrics``, the dashboard at ``/``.

:func:`create_app` builds everything from its arguments (no globals), so tests
inject a core, telemetry and store of their own.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.resources import files

from fastapi import APIRouter, FastAPI, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from expertmesh.controller.api.deps import REPORTS_PREFIX, AppState
from expertmesh.controller.api.errors import BodyLimit, install_error_handlers
from expertmesh.controller.api.routers import (
    balance,
    dashboard,
    health,
    layers,
    plans,
    policy,
    reports,
    solve,
    topology,
)
from expertmesh.controller.api.schemas import ErrorOut
from expertmesh.controller.core import ControllerCore
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.controller.store import SqlitePlanStore
from expertmesh.controller.telemetry import CONTENT_TYPE, Telemetry

__all__ = ["create_app"]

log = logging.getLogger(__name__)

# The dashboard loads nothing from elsewhere. /docs (Swagger UI) loads nothing from elsewhere
# either, but its page starts the UI with an inline script: it gets a CSP of its own.
_SWAGGER_ASSETS = str(files("fastapi_offline") / "static")
_DOCS_CSP = (
    b"default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
    b"script-src 'self' 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'; "
    b"base-uri 'none'; form-action 'none'"
)
_CSP = (
    b"default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)


class _SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        docs = scope["path"].startswith(("/docs", "/redoc"))

        async def with_headers(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                headers = list(msg.get("headers", []))
                headers.append((b"x-content-type-options", b"nosniff"))
                headers.append((b"referrer-policy", b"no-referrer"))
                headers.append((b"content-security-policy", _DOCS_CSP if docs else _CSP))
                msg = {**msg, "headers": headers}
            await send(msg)

        await self.app(scope, receive, with_headers)


def create_app(
    core: ControllerCore,
    telemetry: Telemetry,
    store: SqlitePlanStore,
    settings: SurfaceSettings | None = None,
    *,
    ready_checks: dict[str, Callable[[], bool]] | None = None,
) -> FastAPI:
    """The REST app over ``core``; plan history reads from ``store``."""
    settings = settings or SurfaceSettings()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # while a server runs the app: committed plans' bodies are rendered at commit
        listener = plans.prerender_on_commit(state)
        core.listeners.append(listener)
        committed = core.committed
        if committed is not None:
            listener("committed", committed)
        try:
            yield
        finally:
            if listener in core.listeners:
                core.listeners.remove(listener)

    app = FastAPI(
        lifespan=lifespan,
        title="expertmesh controller",
        version="1.0",
        summary="Expert placement, replication and migration across data centers",
        description=(
            "Read the topology, load windows and plans; solve what-if plans; switch the "
            'policy (bearer token); ingest load reports. Errors are JSON: `{"error": ...}`.'
        ),
        openapi_url="/openapi.json",
        docs_url=None,  # served below from local assets
        redoc_url=None,
    )
    state = AppState(
        core=core,
        telemetry=telemetry,
        store=store,
        settings=settings,
        ready_checks=dict(ready_checks or {}),
    )
    app.state.expertmesh = state
    install_error_handlers(app, core.reject_report)

    def _refused(scope: Scope) -> None:
        if scope["path"].startswith(REPORTS_PREFIX):
            core.reject_report()

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, on_refused=_refused)
    app.add_middleware(_SecurityHeaders)

    # Any operation may answer these (unknown layer/version, malformed or oversized bodies).
    err = {"model": ErrorOut}
    api = APIRouter(prefix="/api/v1", responses={400: err, 404: err, 413: err, 422: err})
    for mod in (topology, layers, plans, solve, policy, reports, health, dashboard, balance):
        api.include_router(mod.router)
    app.include_router(api)

    # HEAD too: uptime checks and some scrapers probe with it (it answered 405)
    @app.api_route("/metrics", methods=["GET", "HEAD"], include_in_schema=False)
    def metrics() -> Response:
        return Response(telemetry.render(), media_type=CONTENT_TYPE)

    # Swagger UI from the fastapi-offline package's copy of its assets: /docs works without
    # reaching a CDN (FastAPI's default page loads them from one)
    app.mount("/docs/assets", StaticFiles(directory=_SWAGGER_ASSETS), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title=f"{app.title} - API",
            swagger_js_url="/docs/assets/swagger-ui-bundle.js",
            swagger_css_url="/docs/assets/swagger-ui.css",
            swagger_favicon_url="/dashboard/favicon.svg",
            swagger_ui_parameters={"validatorUrl": None},  # no badge from validator.swagger.io
        )

    web = settings.dashboard_dir
    if (web / "index.html").is_file():
        app.mount("/dashboard", StaticFiles(directory=web, html=True), name="dashboard")

        @app.get("/", include_in_schema=False)
        def root() -> FileResponse:
            return FileResponse(web / "index.html", media_type="text/html")
    else:
        log.warning("dashboard files not found in %s; / serves nothing", web)

    return app
