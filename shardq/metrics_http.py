"""/metrics over HTTP or HTTPS, for the shard server's metrics port and the operator's.

Served from a daemon thread, only at /metrics. Over TLS each connection asks for the
certificate of the moment (shardq.serving_certificates), so a renewed Secret is served
from the next scrape on, and each handshake runs on the connection's own thread, not the
accepting one, which a silent client would stall.

It needs prometheus_client, which the `server` and `operator` extras install; the client
never imports this module.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# A scraper that connects and says nothing holds one thread this long, no longer.
TLS_HANDSHAKE_TIMEOUT_S = 10.0


class CertificateExpiryCollector(Collector):
    """The served certificate's expiry, registered only by a process that serves TLS (one
    without a certificate has no such series, rather than a zero that looks expired)."""

    def __init__(self, expires_at: Callable[[], float | None], documentation: str) -> None:
        self._expires_at = expires_at
        self._documentation = documentation

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("shardq_tls_certificate_expiration_timestamp_seconds", self._documentation)
        expires_at = self._expires_at()
        if expires_at is not None:
            family.add_metric([], expires_at)
        yield family


def _handler_for(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class MetricsHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "metrics are served at /metrics only")
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Scrapes are not worth a log line each."""

    return MetricsHandler


class _TlsMetricsServer(ThreadingHTTPServer):
    """/metrics over TLS, with the certificate of the moment."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        ssl_context: Callable[[], ssl.SSLContext],
    ) -> None:
        super().__init__(address, handler)
        self.ssl_context = ssl_context

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(TLS_HANDSHAKE_TIMEOUT_S)
        try:
            secured = self.ssl_context().wrap_socket(request, server_side=True)
        except OSError:
            return  # plaintext, a wrong handshake or silence: the connection just closes
        try:
            super().finish_request(secured, client_address)
        except OSError:
            pass  # the scraper went away mid-answer
        finally:
            secured.close()


def start_metrics_server(
    host: str,
    port: int,
    registry: CollectorRegistry,
    ssl_context: Callable[[], ssl.SSLContext] | None = None,
) -> ThreadingHTTPServer:
    """Serve `registry` at /metrics (and only that path) from a daemon thread; over TLS
    with `ssl_context` (asked at each connection, so a renewed certificate is served as
    soon as it loads). Raises OSError if the port cannot be bound."""
    handler = _handler_for(registry)
    server = (
        ThreadingHTTPServer((host, port), handler)
        if ssl_context is None
        else _TlsMetricsServer((host, port), handler, ssl_context)
    )
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
