"""Requests whose bytes do not parse get INVALID_ARGUMENT, naming the message, on every service.

gRPC Python turns an exception in a request deserialiser into ``UNKNOWN: Unexpected DecodeError``:
the sender learns nothing useful and the refusal looks like a server fault. This interceptor
wraps each unary request's deserialiser so that bytes that are not the method's request message
become a marker, and the method then answers INVALID_ARGUMENT before the servicer sees anything.
(The aggregator's device stream, whose requests stream, refuses them itself: ``tally.wire.sized``.)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class _Undecodable:
    size: int


class RefuseUndecodable(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = details.method

        def deserialize(data: bytes):
            try:
                return parse(data)
            except DecodeError:
                return _Undecodable(len(data))

        async def refuse(request, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{method}: the {request.size}-byte request is not a valid request message")

        if handler.response_streaming:
            inner = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, _Undecodable):
                    return await refuse(request, context)
                result = inner(request, context)
                if inspect.isasyncgen(result):
                    async for item in result:
                        await context.write(item)
                    return None
                return await result

            return handler._replace(request_deserializer=deserialize, unary_stream=unary_stream)

        inner = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, _Undecodable):
                return await refuse(request, context)
            return await inner(request, context)

        return handler._replace(request_deserializer=deserialize, unary_unary=unary_unary)
