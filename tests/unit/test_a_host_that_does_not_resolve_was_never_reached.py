"""A call whose host name does not resolve reached no server and changed nothing.

A client outside the cluster's network (the CLI on a laptop, through the cluster
Service) is told the leaders' in-cluster names, which do not resolve there. The client
then asks its endpoint instead, but only for calls it knows were never sent: a name
that did not resolve read as a call cut off mid-way, and a send or delete answered
OUTCOME_UNKNOWN where it should have gone through the endpoint.

A real gRPC channel and a real resolver; `.invalid` never resolves (RFC 6761)."""

from __future__ import annotations

import grpc
import pytest

from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.errors import Reason
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
