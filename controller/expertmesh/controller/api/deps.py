"""Shared state and ``Annotated`` dependencies of the REST routers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from expertmesh.controller.auth import token_matches
from expertmesh.controller.core import ControllerCore, PlanVersion
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.controller.store import SqlitePlanStore
from expertmesh.controller.telemetry import Telemetry

REPORTS_PREFIX = "/api/v1/reports"


@dataclass
class AppState:
    """What every request handler may use; one per app (no module globals)."""

    core: ControllerCore
    telemetry: Telemetry
    store: SqlitePlanStore
    settings: SurfaceSettings
    # name -> check; /api/v1/ready is 200 only when every check returns True
    ready_checks: dict[str, Callable[[], bool]] = field(default_factory=dict)
    # committed plans are immutable: their JSON is rendered once
    plan_json: dict[tuple[int, bool], bytes] = field(default_factory=dict)
    plan_json_lock: threading.Lock = field(default_factory=threading.Lock)
    # layer -> (monotonic time, JSON) of the newest dashboard snapshot
    dashboard_cache: dict[int, tuple[float, bytes]] = field(default_factory=dict)

    def find_plan(self, version: int) -> PlanVersion:
        """A plan this controller knows (memory first, then the store); 404 otherwise."""
        try:
            return self.core.get(version)
        except ValueError:
            pass
        pv = self.store.get(version)
        if pv is None:
            raise HTTPException(404, f"unknown plan version {version}")
        return pv


async def get_state(request: Request) -> AppState:  # async: no threadpool hop per request
    state: AppState = request.app.state.expertmesh
    return state


StateDep = Annotated[AppState, Depends(get_state)]

# Documents the scheme in the OpenAPI schema; the check itself reads the raw header with the
# rule gRPC applies too (controller/auth.py).
_bearer = HTTPBearer(auto_error=False, description="EXPERTMESH_TOKEN")
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _token_ok(state: AppState, request: Request) -> bool:
    return token_matches(request.headers.get("authorization"), state.settings.token_value())


def require_admin(state: StateDep, request: Request, _creds: BearerDep) -> None:
    """Changing policy or settings: needs the configured token; refused if none is configured."""
    if state.settings.token_value() is None:
        raise HTTPException(403, "writes are disabled: no token is configured (EXPERTMESH_TOKEN)")
    if not _token_ok(state, request):
        raise HTTPException(
            401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
        )


def require_ingest(state: StateDep, request: Request, _creds: BearerDep) -> None:
    """Load reports: need the token when one is configured (then counted as rejected)."""
    if state.settings.token_value() is not None and not _token_ok(state, request):
        state.core.reject_report()
        raise HTTPException(
            401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
        )


AdminDep = Annotated[None, Depends(require_admin)]
IngestDep = Annotated[None, Depends(require_ingest)]
