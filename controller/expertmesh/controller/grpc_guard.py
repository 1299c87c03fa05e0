"""A gRPC server interceptor that refuses requests whose bytes are not a valid message.

grpc decodes a request with the method's deserializer before any handler runs; a
deserializer that raises (``google.protobuf.message.DecodeError`` on garbage bytes)
ends the call with ``UNKNOWN "Unexpected <class ...>"`` and an ERROR log with a
traceback, which anyone who reaches the port can trigger. :class:`UndecodableRequests`
wraps every method's deserializer so that garbage becomes an :class:`Undecodable`
marker instead of an exception, and every handler so that the marker ends the call
with ``INVALID_ARGUMENT``, one WARNING line, and ``on_refused(method)`` (the service
counts a refused ``ReportLoad`` as a rejected report). Applies to every service on the
server (health and reflection too).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

__all__ = ["Undecodable", "UndecodableRequests"]

log = logging.getLogger(__name__)


class Undecodable:
    """What a wrapped deserializer returns for bytes that are not a valid message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _safe(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as err:  # DecodeError, or whatever a deserializer raises on garbage
            return Undecodable(f"{type(err).__name__}: {err}"[:200])

    return decode


class UndecodableRequests(grpc.aio.ServerInterceptor):
    """See the module docstring. ``on_refused(method)`` is called once per refused request
    (``method``: the full path, ``/package.Service/Method``)."""

    def __init__(self, on_refused: Callable[[str], None] | None = None) -> None:
        self._on_refused = on_refused

    async def _refuse(self, method: str, bad: Undecodable, context: Any) -> None:
        log.warning(
            "gRPC %s refused: the request is not a valid message (%s) from %s",
            method,
            bad.error,
            context.peer(),
        )
        if self._on_refused is not None:
            try:
                self._on_refused(method)
            except Exception:  # counting must not turn a refusal into an internal error
                log.exception("counting a refused %s failed", method)
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is not a valid {method.rsplit('/', 1)[-1]} message: {bad.error}",
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        if not hasattr(handler, "_replace"):  # not grpc's own handler tuple: leave it
            return handler
        method = str(handler_call_details.method)
        refuse = self._refuse
        kind = (
            "unary_unary"
            if handler.unary_unary
            else "unary_stream"
            if handler.unary_stream
            else "stream_unary"
            if handler.stream_unary
            else "stream_stream"
        )
        inner = getattr(handler, kind)
        wrapped: Callable[..., Any]
        if not handler.request_streaming:
            if inspect.isasyncgenfunction(inner):

                async def gen_one(request: Any, context: Any) -> AsyncIterator[Any]:
                    if isinstance(request, Undecodable):
                        await refuse(method, request, context)
                    async for item in inner(request, context):
                        yield item

                wrapped = gen_one
            else:

                async def one(request: Any, context: Any) -> Any:
                    if isinstance(request, Undecodable):
                        await refuse(method, request, context)
                    return await inner(request, context)

                wrapped = one
        else:

            async def checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
                async for request in requests:
                    if isinstance(request, Undecodable):
                        await refuse(method, request, context)
                    yield request

            if inspect.isasyncgenfunction(inner):

                async def gen_many(
                    requests: AsyncIterator[Any], context: Any
                ) -> AsyncIterator[Any]:
                    async for item in inner(checked(requests, context), context):
                        yield item

                wrapped = gen_many
            else:

                async def many(requests: AsyncIterator[Any], context: Any) -> Any:
                    return await inner(checked(requests, context), context)

                wrapped = many
        return handler._replace(
            request_deserializer=_safe(handler.request_deserializer), **{kind: wrapped}
        )
