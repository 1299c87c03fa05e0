"""Errors as JSON (``{"error": ..., "detail": ...}``) and the request-size limit."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)


def _error(status: int, message: str, detail: Any = None, headers: Any = None) -> JSONResponse:
    body: dict[str, Any] = {"error": message}
    if detail is not None:
        body["detail"] = detail
    return JSONResponse(body, status_code=status, headers=headers)


def _where(loc: Any) -> str:
    return ".".join(str(p) for p in loc if p != "body") or "body"


def install_error_handlers(app: FastAPI, on_report_rejected: Callable[[], None]) -> None:
    """400 malformed JSON, 422 wrong shape/type/bounds, HTTP errors as JSON, 500 as JSON.

    Refused requests to the report endpoints call ``on_report_rejected``.
    """

    def _is_report(request: Request) -> bool:
        return request.method == "POST" and request.url.path.startswith("/api/v1/reports")

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if _is_report(request):
            on_report_rejected()
        errors = exc.errors()
        # keep messages only: inputs may be huge and contexts may not serialize
        detail = [{"loc": _where(e.get("loc", ())), "msg": str(e.get("msg", ""))} for e in errors]
        detail = detail[:20]
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return _error(400, f"malformed JSON: {first.get('ctx', {}).get('error', 'invalid')}")
        msg = f"invalid request: {detail[0]['loc']}: {detail[0]['msg']}" if detail else "invalid"
        return _error(422, msg, detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            # Starlette names the methods of the first route whose path matched; a path
            # served by several routes (GET and PUT /api/v1/policy) allows all of theirs
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(request))}
        return _error(exc.status_code, str(exc.detail), headers=headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(500, "internal error")


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app serves at the request's path: each method is
    matched against the app's routes as a request with it would be (static mounts serve
    GET and HEAD)."""
    allowed: list[str] = []
    for method in _METHODS:
        scope = {**request.scope, "method": method}
        for route in request.app.router.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL and (not isinstance(route, Mount) or method in ("GET", "HEAD")):
                allowed.append(method)
                break
    return allowed


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with 413 before the app runs.

    The body is read (at most ``max_bytes``) and replayed to the app, so chunked uploads
    without ``Content-Length`` are bounded too.
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, on_refused: Callable[[Scope], None] | None = None
    ) -> None:
        self.app, self.max_bytes, self.on_refused = app, max_bytes, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await self._refuse(scope, send, 400, "bad Content-Length")
                return
            if declared > self.max_bytes:
                await self._refuse(scope, send, 413, self._too_large())
                return
        chunks: list[bytes] = []
        total = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                await self._refuse(scope, send, 413, self._too_large())
                return
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks)}]

        async def replayed() -> Message:
            if replay:
                return replay.pop()
            return await receive()

        await self.app(scope, replayed, send)

    def _too_large(self) -> str:
        return f"request body larger than {self.max_bytes} bytes"

    async def _refuse(self, scope: Scope, send: Send, status: int, message: str) -> None:
        if self.on_refused is not None:
            self.on_refused(scope)
        body = json.dumps({"error": message}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
