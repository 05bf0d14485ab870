"""Standard gRPC health checking and reflection are on (grpcurl works)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.support.servers import ServerProcess


def test_health_check_reports_serving(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.endpoint) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "shardq.v1.QueueService"):
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as raised:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_queue_service(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.endpoint) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
    names = {service.name for r in responses for service in r.list_services_response.service}
    assert {"shardq.v1.QueueService", "grpc.health.v1.Health"} <= names
