"""Requests that do not decode are INVALID_ARGUMENT with an ErrorInfo, never UNKNOWN.

gRPC answers a request whose bytes its deserializer rejects with UNKNOWN and
no detail, and drops an undecodable frame of a client stream. This interceptor
wraps each method's deserializer: bytes that do not parse become a marker, and
the call ends with INVALID_ARGUMENT naming the field `request`, as every other
bad request does (a stream's earlier frames are answered first).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError

from shard_server.service.errors import abort_with
from shardq.errors import InvalidArgument

Context = grpc.aio.ServicerContext[Any, Any]


class Undecodable:
    """What a request that did not parse turns into."""

    def __init__(self, method: str, error: Exception) -> None:
        self.error = InvalidArgument("request", f"not a valid {method} request message ({type(error).__name__})")


def _tolerant(deserialize: Callable[[bytes], Any] | None, method: str) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserialize(data)
        except (DecodeError, ValueError, TypeError) as error:
            return Undecodable(method, error)

    return decode


class RejectingUndecodable(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        deserialize = _tolerant(handler.request_deserializer, method)
        serialize = handler.response_serializer

        async def checked_frames(frames: AsyncIterator[Any], refused: list[InvalidArgument]) -> AsyncIterator[Any]:
            # An undecodable frame ends the request stream here; the call then ends with
            # INVALID_ARGUMENT once the handler has answered the frames before it.
            async for frame in frames:
                if isinstance(frame, Undecodable):
                    refused.append(frame.error)
                    return
                yield frame

        if handler.request_streaming and handler.response_streaming:
            both = cast(Callable[[Any, Context], AsyncGenerator[Any, None]], handler.stream_stream)

            async def stream_stream(frames: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
                refused: list[InvalidArgument] = []
                async with contextlib.aclosing(both(checked_frames(frames, refused), context)) as responses:
                    async for response in responses:
                        yield response
                if refused:
                    await abort_with(context, refused[0])

            return grpc.stream_stream_rpc_method_handler(
                stream_stream, request_deserializer=deserialize, response_serializer=serialize
            )
        if handler.request_streaming:
            many_to_one = cast(Callable[[Any, Context], Awaitable[Any]], handler.stream_unary)

            async def stream_unary(frames: AsyncIterator[Any], context: Context) -> Any:
                refused: list[InvalidArgument] = []
                answer = await many_to_one(checked_frames(frames, refused), context)
                if refused:
                    await abort_with(context, refused[0])
                return answer

            return grpc.stream_unary_rpc_method_handler(
                stream_unary, request_deserializer=deserialize, response_serializer=serialize
            )
        if handler.response_streaming:
            one_to_many = cast(Callable[[Any, Context], AsyncGenerator[Any, None]], handler.unary_stream)

            async def unary_stream(request: Any, context: Context) -> AsyncIterator[Any]:
                if isinstance(request, Undecodable):
                    await abort_with(context, request.error)
                async with contextlib.aclosing(one_to_many(request, context)) as responses:
                    async for response in responses:
                        yield response

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=deserialize, response_serializer=serialize
            )
        one_to_one = cast(Callable[[Any, Context], Awaitable[Any]], handler.unary_unary)

        async def unary_unary(request: Any, context: Context) -> Any:
            if isinstance(request, Undecodable):
                await abort_with(context, request.error)
            return await one_to_one(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, request_deserializer=deserialize, response_serializer=serialize
        )
