"""Requests whose bytes do not parse get INVALID_ARGUMENT, naming the message, on every service.

gRPC Python turns an exception in a request deserialiser into ``UNKNOWN: Unexpected DecodeError``:
the sender learns nothing useful and the refusal looks like a server fault. This interceptor
wraps each unary request's deserialiser so that bytes that are not the method's request message
become a marker, and the method then answers INVALID_ARGUMENT before the servicer sees anything.
(The aggregator's device stream, whose requests stream, refuses them itself: ``tally.wire.sized``.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import AsyncGeneratorType
from typing import Any, Protocol, TypeAlias, cast

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class _Undecodable:
    size: int


# Every method of every service passes here, whatever its messages: hence the Any. (Strings:
# grpc's classes are generic in its stubs only.)
_Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
_Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class _AioHandler(Protocol):
    """A handler as grpc.aio gives it to an interceptor: grpc's handler namedtuple, holding
    coroutine functions and async generators (grpc-stubs type the blocking handler's callables)."""

    unary_unary: Callable[[object, _Context], Awaitable[object]]
    unary_stream: Callable[[object, _Context], AsyncGeneratorType[object, None] | Awaitable[None]]

    def _replace(self, **fields: object) -> _Handler: ...


class RefuseUndecodable(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> _Handler | None:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = details.method
        aio = cast(_AioHandler, handler)

        def deserialize(data: bytes) -> object:
            try:
                return parse(data)
            except DecodeError:
                return _Undecodable(len(data))

        async def refuse(request: _Undecodable, context: _Context) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{method}: the {request.size}-byte request is not a valid request message")

        if handler.response_streaming:
            inner_stream = aio.unary_stream

            async def unary_stream(request: object, context: _Context) -> None:
                if isinstance(request, _Undecodable):
                    return await refuse(request, context)
                result = inner_stream(request, context)
                if isinstance(result, AsyncGeneratorType):
                    async for item in result:
                        await context.write(item)
                    return None
                return await result

            return aio._replace(request_deserializer=deserialize, unary_stream=unary_stream)

        inner = aio.unary_unary

        async def unary_unary(request: object, context: _Context) -> object:
            if isinstance(request, _Undecodable):
                await refuse(request, context)
                return None
            return await inner(request, context)

        return aio._replace(request_deserializer=deserialize, unary_unary=unary_unary)
