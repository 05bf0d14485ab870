"""The certificate a server presents on its gRPC and metrics ports (`--tls-cert-file`,
`--tls-key-file`), read again when its files change, and the CA it checks its peers'
certificates against (`--tls-ca-file`).

In a pod the files are a mounted Secret, which the kubelet replaces whole (a symlink
swap) when cert-manager renews it: a server that read them once would serve the old
certificate until it expired. Each new connection looks at the files' identity (inode,
size, modification time: a stat, no read) and loads them again when it changed; a pair
that does not load (the key written before the certificate) leaves the last good pair in
use and is tried again on the next connection.
"""

from __future__ import annotations

import logging
import os
import pathlib
import ssl
import threading
import time
from dataclasses import dataclass

import grpc

from shard_server.runtime.certificate_expiry import not_after
from shardq.errors import InvalidArgument
from shardq.tls import ClientTls

log = logging.getLogger(__name__)

# What gRPC says when a call to a peer failed in its TLS handshake (BoringSSL's words).
HANDSHAKE_FAILURE_TEXTS = ("Tls handshake failed", "Ssl handshake failed", "Hostname Verification")
# A peer whose certificate fails is said once in this long, not on every call or heartbeat.
PEER_FAILURE_SAID_EVERY_S = 60.0
_peer_failures_said: dict[str, float] = {}

FileIdentity = tuple[int, int, int, int]
# A served certificate this close to its end is logged when loaded (the chart's alert
# fires at the same distance).
EXPIRY_WARNING_S = 14 * 86400.0


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


@dataclass(frozen=True)
class _Loaded:
    identity: tuple[FileIdentity, FileIdentity]
    cert_chain: bytes
    key: bytes
    context: ssl.SSLContext
    # When the presented certificate expires (Unix seconds); None if its dates do not read.
    expires_at: float | None


def _identity(path: pathlib.Path) -> FileIdentity:
    status = os.stat(path)  # follows the Secret's symlinks to the file of the moment
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def _load(files: TlsFiles) -> _Loaded:
    """Read and check the pair; raises InvalidArgument naming the file and what is wrong."""
    try:
        identity = (_identity(files.cert), _identity(files.key))
        cert_chain = files.cert.read_bytes()
        key = files.key.read_bytes()
    except OSError as error:
        raise InvalidArgument("--tls-cert-file", f"cannot read {error.filename}: {error.strerror or error}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # Python's ssl checks what gRPC would only find at the first handshake: that both
        # files are PEM and the key is the certificate's.
        context.load_cert_chain(files.cert, files.key)
    except ssl.SSLError as error:
        if error.reason == "KEY_VALUES_MISMATCH":
            problem = f"{files.key} is not the private key of {files.cert}"
        else:
            problem = (
                f"{files.cert} and {files.key} are not a PEM certificate and its private key ({error.reason or error})"
            )
        raise InvalidArgument("--tls-cert-file", problem) from None
    return _Loaded(identity=identity, cert_chain=cert_chain, key=key, context=context, expires_at=not_after(cert_chain))


def check_tls_files(files: TlsFiles) -> None:
    """Raise InvalidArgument naming what is wrong with the files, before a server starts."""
    _load(files)
    files.peer_tls()


def _say_if_expiring(cert: pathlib.Path, expires_at: float | None) -> None:
    """Log a certificate that has expired (every client and peer refuses it) or expires
    within EXPIRY_WARNING_S, each time it is loaded: for users without the metric's alert."""
    if expires_at is None:
        return
    left = expires_at - time.time()
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires_at))
    if left <= 0:
        log.error("the TLS certificate in %s expired at %s: clients and peers refuse it; renew it", cert, when)
    elif left < EXPIRY_WARNING_S:
        log.warning("the TLS certificate in %s expires at %s, in %.1f days; renew it", cert, when, left / 86400)


class ServingCertificate:
    """The pair of files a server presents, loaded now (InvalidArgument if they do not
    load) and again whenever a new connection finds them changed."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._loaded = _load(files)
        _say_if_expiring(files.cert, self._loaded.expires_at)
        self._lock = threading.Lock()
        self._failed_identity: tuple[FileIdentity, FileIdentity] | None = None

    def _current(self) -> _Loaded:
        """The pair to present now."""
        try:
            identity = (_identity(self.files.cert), _identity(self.files.key))
        except OSError:
            return self._loaded  # mid-swap: the last pair serves
        if identity in (self._loaded.identity, self._failed_identity):
            return self._loaded
        with self._lock:
            if identity in (self._loaded.identity, self._failed_identity):
                return self._loaded
            try:
                loaded = _load(self.files)
            except InvalidArgument as error:
                # Tried again only once the files change again: not read on every connection.
                self._failed_identity = identity
                log.warning("the TLS files changed but do not load; still serving the last certificate: %s", error)
                return self._loaded
            self._loaded = loaded
            log.info("serving the TLS certificate in %s again: its files changed", self.files.cert)
            _say_if_expiring(self.files.cert, loaded.expires_at)
            return loaded

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Server credentials whose certificate follows the files."""

        def configuration(loaded: _Loaded) -> grpc.ServerCertificateConfiguration:
            return grpc.ssl_server_certificate_configuration([(loaded.key, loaded.cert_chain)])

        handed = [self._loaded]

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            # gRPC asks before every handshake; None keeps what it has.
            loaded = self._current()
            if loaded is handed[0]:
                return None
            handed[0] = loaded
            return configuration(loaded)

        # The stubs' fetcher may not return None; gRPC's documentation says None keeps the
        # configuration it has, which is what an unchanged pair needs.
        return grpc.dynamic_ssl_server_credentials(configuration(self._loaded), fetch)  # type: ignore[arg-type]

    def ssl_context(self) -> ssl.SSLContext:
        """The context for the next connection to the metrics port."""
        return self._current().context

    def expires_at(self) -> float | None:
        """When the certificate new connections are shown expires (Unix seconds): a
        renewal that did not load leaves the old one's date, which is what an alert
        must see."""
        return self._current().expires_at


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
