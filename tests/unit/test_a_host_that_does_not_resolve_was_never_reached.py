"""A call whose host name does not resolve reached no server and changed nothing.

A client outside the cluster's network (the CLI on a laptop, through the cluster
Service) is told the leaders' in-cluster names, which do not resolve there. The client
then asks its endpoint instead, but only for calls it knows were never sent: a name
that did not resolve read as a call cut off mid-way, and a send or delete answered
OUTCOME_UNKNOWN where it should have gone through the endpoint.

A real gRPC channel and a real resolver; `.invalid` never resolves (RFC 6761)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shardq import AsyncClient
from shardq.aio import CONNECT_GRACE_S
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.errors import Reason, Unavailable
from shardq.status import error_from_rpc, never_sent, unknown_if_sent


def test_a_call_to_a_name_that_does_not_resolve_was_never_sent() -> None:
    with grpc.insecure_channel("shardq-0.shardq-peers.invalid:7600") as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        with pytest.raises(grpc.RpcError) as failed:
            stub.DeleteMessages(queue_pb2.DeleteMessagesRequest(queue="orders", receipts=["r"]), timeout=30)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    assert never_sent(failed.value), failed.value.details()
    failure = unknown_if_sent(failed.value, error_from_rpc(failed.value), "the delete")
    assert failure.reason is Reason.UNAVAILABLE, failure


def test_a_client_tells_at_once_that_its_endpoint_does_not_resolve() -> None:
    """It does not wait out the grace it gives a restarting server to come up (3 s a
    call, for a name that will not resolve in a moment either): within half the grace
    the call has failed UNAVAILABLE, where it was still waiting for the connection."""

    async def scenario() -> Unavailable:
        async with AsyncClient("shardq.invalid:7600") as client:
            with pytest.raises(Unavailable) as failed:
                await asyncio.wait_for(client.list_queues(), CONNECT_GRACE_S / 2)
            return failed.value

    error = asyncio.run(scenario())
    assert "Domain name not found" in error.message or "resolving" in error.message, error.message
