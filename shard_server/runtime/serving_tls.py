"""The files a server serves TLS with: the certificate it presents on its gRPC and metrics
ports (`--tls-cert-file`, `--tls-key-file`; read again when they change, see
shardq.serving_certificates), and the CA it checks its peers' certificates against
(`--tls-ca-file`).
"""

from __future__ import annotations

import logging
import pathlib
import time
from dataclasses import dataclass

import grpc

from shardq.serving_certificates import ServingCertificate, check_serving_pair
from shardq.tls import ClientTls

log = logging.getLogger(__name__)

# What gRPC says when a call to a peer failed in its TLS handshake (BoringSSL's words).
HANDSHAKE_FAILURE_TEXTS = ("Tls handshake failed", "Ssl handshake failed", "Hostname Verification")
# A peer whose certificate fails is said once in this long, not on every call or heartbeat.
PEER_FAILURE_SAID_EVERY_S = 60.0
_peer_failures_said: dict[str, float] = {}


@dataclass(frozen=True)
class TlsFiles:
    cert: pathlib.Path
    key: pathlib.Path
    # The CA the server checks its peers against; None: the system's roots.
    ca: pathlib.Path | None = None

    def peer_tls(self) -> ClientTls:
        """How this server calls its peers: TLS, checking their certificates against the CA."""
        if self.ca is None:
            return ClientTls()
        return ClientTls.from_ca_file(self.ca, field="--tls-ca-file")


def check_tls_files(files: TlsFiles) -> None:
    """Raise InvalidArgument naming what is wrong with the files, before a server starts."""
    check_serving_pair(files.cert, files.key, "--tls-cert-file")
    files.peer_tls()


def serving_certificate(files: TlsFiles) -> ServingCertificate:
    """The pair the server presents on its gRPC and metrics ports, following renewals."""
    return ServingCertificate(files.cert, files.key, option="--tls-cert-file")


def say_if_peer_tls_failed(error: grpc.RpcError, peer: str) -> None:
    """Log (at most once a minute per peer) a call to `peer` that failed its TLS
    handshake: otherwise only the client that called, or an ISR without the peer, shows it."""
    details = error.details() or ""
    if not any(text in details for text in HANDSHAKE_FAILURE_TEXTS):
        return
    now = time.monotonic()
    if now - _peer_failures_said.get(peer, -PEER_FAILURE_SAID_EVERY_S) < PEER_FAILURE_SAID_EVERY_S:
        return
    _peer_failures_said[peer] = now
    log.warning(
        "cannot reach peer %s over TLS (check --tls-ca-file and the names its certificate carries): %s", peer, details
    )
