"""How a client reaches servers that serve TLS (`shardq serve --tls-cert-file ...`).

A client with `ClientTls` speaks TLS to every server it calls (the endpoint and, when it
routes directly, each shard leader) and checks each server's certificate against
`root_certificates` (PEM; None: the system's trusted roots). The name checked is the
host of the address called, unless `server_name` says otherwise: needed when the address
is not a name in the certificate (a pod's IP, a `kubectl port-forward` to 127.0.0.1).

For every client in a process (the CLI, `Client`, `AsyncClient`, the Spark source) not
given TLS settings: `SHARDQ_CA_FILE` names a CA file and turns TLS on; `SHARDQ_TLS=1`
turns it on with the system's roots; `SHARDQ_TLS_SERVER_NAME` is the name to check.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from shardq.errors import InvalidArgument

CA_FILE_ENV = "SHARDQ_CA_FILE"
TLS_ENV = "SHARDQ_TLS"
SERVER_NAME_ENV = "SHARDQ_TLS_SERVER_NAME"
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
PEM_CERTIFICATE_MARKER = b"-----BEGIN CERTIFICATE-----"


@dataclass(frozen=True)
class ClientTls:
    root_certificates: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_ca_file(
        cls, path: str | os.PathLike[str], server_name: str | None = None, *, field: str = "ca_file"
    ) -> ClientTls:
        """TLS trusting the CA certificates in `path` (PEM). Raises InvalidArgument naming
        `field` for a file that cannot be read or holds no certificate."""
        return cls(root_certificates=read_ca_file(path, field), server_name=server_name or None)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [] if self.server_name is None else [("grpc.ssl_target_name_override", self.server_name)]


def read_ca_file(path: str | os.PathLike[str], field: str) -> bytes:
    try:
        pem = pathlib.Path(path).read_bytes()
    except OSError as error:
        raise InvalidArgument(field, f"cannot read the CA file {path}: {error.strerror or error}") from None
    if PEM_CERTIFICATE_MARKER not in pem:
        # gRPC would take it and fail every handshake later with a line in its C core's log.
        raise InvalidArgument(field, f"the CA file {path} holds no PEM certificate ({PEM_CERTIFICATE_MARKER.decode()})")
    return pem


def client_tls(
    tls: ClientTls | bool | None = None,
    ca_file: str | os.PathLike[str] | None = None,
    server_name: str | None = None,
) -> ClientTls | None:
    """The TLS a client was given (`tls=True`: the system's roots; `ca_file`: that CA), or
    the environment's (SHARDQ_CA_FILE, SHARDQ_TLS, SHARDQ_TLS_SERVER_NAME), or None:
    plaintext. `tls=False` is plaintext whatever the environment says."""
    if isinstance(tls, ClientTls):
        if ca_file is not None:
            raise InvalidArgument("ca_file", "give TLS settings or a CA file, not both")
        return tls
    if ca_file is not None:
        if tls is False:
            raise InvalidArgument("ca_file", "a CA file is for TLS, and tls is False")
        return ClientTls.from_ca_file(ca_file, server_name)
    if tls:
        return ClientTls(server_name=server_name or None)
    if tls is None:
        name = server_name or os.environ.get(SERVER_NAME_ENV) or None
        ca_from_environment = os.environ.get(CA_FILE_ENV)
        if ca_from_environment:
            return ClientTls.from_ca_file(ca_from_environment, name, field=CA_FILE_ENV)
        if os.environ.get(TLS_ENV, "").strip().lower() in TRUE_WORDS:
            return ClientTls(server_name=name)
    if server_name is not None:
        raise InvalidArgument("server_name", "a TLS server name needs TLS: give tls=True or a CA file")
    return None


def aio_channel(address: str, tls: ClientTls | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to `address`, over TLS when `tls` is set."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.credentials(), options=[*options, *tls.channel_options()])


def blocking_channel(address: str, tls: ClientTls | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking channel to `address`, over TLS when `tls` is set."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.credentials(), options=[*options, *tls.channel_options()])
