"""Every RPC counted by method and gRPC status code, and open streams gauged.

A server interceptor, so no servicer can forget it: unary answers are counted
when they return or abort, streams when they end (cancelled ones as CANCELLED).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, cast

import grpc

from shard_server import metrics

Context = grpc.aio.ServicerContext[Any, Any]
StreamBehaviour = Callable[[Any, Context], AsyncGenerator[Any, None]]


def _code_name(context: Context, *, failed: bool, cancelled: bool = False) -> str:
    if cancelled:
        return grpc.StatusCode.CANCELLED.name
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return grpc.StatusCode.UNKNOWN.name if failed else grpc.StatusCode.OK.name


def _short_method(full: str) -> str:
    # "/shardq.api.v1.QueueService/SendMessages" -> "QueueService/SendMessages"
    return full.rsplit(".", 1)[-1] if full.startswith("/") else full


class ObservingInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = _short_method(handler_call_details.method)
        requests = metrics.REQUESTS
        if handler.response_streaming:
            streams = metrics.OPEN_STREAMS.labels(method)
            # grpc.aio runs coroutine and async-generator behaviours; its stubs type them as sync.
            behaviour = cast(StreamBehaviour, handler.unary_stream or handler.stream_stream)

            async def streamed(request: Any, context: Context) -> AsyncIterator[Any]:
                streams.inc()
                failed = cancelled = False
                try:
                    # Closed at once when the call ends early, not whenever the
                    # collector gets to it: handlers release resources in `finally`.
                    async with contextlib.aclosing(behaviour(request, context)) as responses:
                        async for response in responses:
                            yield response
                except BaseException as error:
                    failed = True
                    cancelled = isinstance(error, (GeneratorExit, asyncio.CancelledError))
                    raise
                finally:
                    streams.dec()
                    requests.labels(method, _code_name(context, failed=failed, cancelled=cancelled)).inc()

            make_streaming = (
                grpc.unary_stream_rpc_method_handler
                if handler.unary_stream is not None
                else grpc.stream_stream_rpc_method_handler
            )
            return make_streaming(
                streamed,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        behaviour_once = cast(Callable[[Any, Context], Awaitable[Any]], handler.unary_unary or handler.stream_unary)
        client_streaming = handler.stream_unary is not None
        if client_streaming:
            streams = metrics.OPEN_STREAMS.labels(method)

        async def answered(request: Any, context: Context) -> Any:
            if client_streaming:
                streams.inc()
            failed = cancelled = False
            try:
                return await behaviour_once(request, context)
            except BaseException as error:
                failed = True
                cancelled = isinstance(error, asyncio.CancelledError)
                raise
            finally:
                if client_streaming:
                    streams.dec()
                requests.labels(method, _code_name(context, failed=failed, cancelled=cancelled)).inc()

        make_answering = (
            grpc.stream_unary_rpc_method_handler if client_streaming else grpc.unary_unary_rpc_method_handler
        )
        return make_answering(
            answered,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
