"""A certificate and key a process serves TLS with, read again when their files change:
the shard server's (`shardq serve --tls-cert-file`, on its gRPC and metrics ports) and
the operator's (`shardq operator --metrics-tls-cert-file`, on its metrics port).

In a pod the files are a mounted Secret, which the kubelet replaces whole (a symlink
swap) when cert-manager renews it: a process that read them once would serve the old
certificate until it expired. Each new connection looks at the files' identity (inode,
size, modification time: a stat, no read) and loads them again when it changed; a pair
that does not load (the key written before the certificate) leaves the last good pair in
use and is tried again once the files change again.
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

from shardq.certificate_expiry import not_after
from shardq.errors import InvalidArgument

log = logging.getLogger(__name__)

FileIdentity = tuple[int, int, int, int]
# A served certificate this close to its end is logged when loaded (the chart's alert
# fires at the same distance).
EXPIRY_WARNING_S = 14 * 86400.0


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


def _load(cert: pathlib.Path, key_file: pathlib.Path, option: str) -> _Loaded:
    """Read and check the pair; raises InvalidArgument naming `option` (the flag that gave
    the files), the file and what is wrong."""
    try:
        identity = (_identity(cert), _identity(key_file))
        cert_chain = cert.read_bytes()
        key = key_file.read_bytes()
    except OSError as error:
        raise InvalidArgument(option, f"cannot read {error.filename}: {error.strerror or error}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # Python's ssl checks what gRPC would only find at the first handshake: that both
        # files are PEM and the key is the certificate's.
        context.load_cert_chain(cert, key_file)
    except ssl.SSLError as error:
        if error.reason == "KEY_VALUES_MISMATCH":
            problem = f"{key_file} is not the private key of {cert}"
        else:
            problem = f"{cert} and {key_file} are not a PEM certificate and its private key ({error.reason or error})"
        raise InvalidArgument(option, problem) from None
    return _Loaded(identity=identity, cert_chain=cert_chain, key=key, context=context, expires_at=not_after(cert_chain))


def check_serving_pair(cert: pathlib.Path, key: pathlib.Path, option: str) -> None:
    """Raise InvalidArgument naming what is wrong with the pair, before a process starts
    (and without the expiry's log line, which ServingCertificate says once it serves)."""
    _load(cert, key, option)


def _say_if_expiring(cert: pathlib.Path, expires_at: float | None) -> None:
    """Log a certificate that has expired (every client refuses it) or expires within
    EXPIRY_WARNING_S, each time it is loaded: for users without the metric's alert."""
    if expires_at is None:
        return
    left = expires_at - time.time()
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires_at))
    if left <= 0:
        log.error("the TLS certificate in %s expired at %s: clients and peers refuse it; renew it", cert, when)
    elif left < EXPIRY_WARNING_S:
        log.warning("the TLS certificate in %s expires at %s, in %.1f days; renew it", cert, when, left / 86400)


class ServingCertificate:
    """The pair of files a process presents, loaded now (InvalidArgument naming `option`
    if they do not load) and again whenever a new connection finds them changed."""

    def __init__(self, cert: pathlib.Path, key: pathlib.Path, *, option: str = "--tls-cert-file") -> None:
        self.cert = cert
        self.key = key
        self.option = option
        self._loaded = _load(cert, key, option)
        _say_if_expiring(cert, self._loaded.expires_at)
        self._lock = threading.Lock()
        self._failed_identity: tuple[FileIdentity, FileIdentity] | None = None

    def _current(self) -> _Loaded:
        """The pair to present now."""
        try:
            identity = (_identity(self.cert), _identity(self.key))
        except OSError:
            return self._loaded  # mid-swap: the last pair serves
        if identity in (self._loaded.identity, self._failed_identity):
            return self._loaded
        with self._lock:
            if identity in (self._loaded.identity, self._failed_identity):
                return self._loaded
            try:
                loaded = _load(self.cert, self.key, self.option)
            except InvalidArgument as error:
                # Tried again only once the files change again: not read on every connection.
                self._failed_identity = identity
                log.warning("the TLS files changed but do not load; still serving the last certificate: %s", error)
                return self._loaded
            self._loaded = loaded
            log.info("serving the TLS certificate in %s again: its files changed", self.cert)
            _say_if_expiring(self.cert, loaded.expires_at)
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
        """The context for the next connection to a metrics port."""
        return self._current().context

    def expires_at(self) -> float | None:
        """When the certificate new connections are shown expires (Unix seconds): a
        renewal that did not load leaves the old one's date, which is what an alert
        must see."""
        return self._current().expires_at
