"""The ErrorInfo a refused call carries in its gRPC status details (reason, domain, and
the field at fault), read from the raw status: what a client in any language sees."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]


def error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    """The one ErrorInfo of `error`'s status details (fails the test if there is none)."""
    assert isinstance(error, grpc.Call)
    details = [v for k, v in error.trailing_metadata() or () if k == "grpc-status-details-bin"]
    assert len(details) == 1, "no grpc-status-details-bin trailer"
    status = status_pb2.Status.FromString(details[0])
    assert status.code == error.code().value[0]
    infos = []
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            infos.append(info)
    assert len(infos) == 1
    return infos[0]
