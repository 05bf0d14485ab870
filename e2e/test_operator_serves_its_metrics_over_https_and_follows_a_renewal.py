"""The operator's metrics port speaks HTTPS when given a certificate
(`--metrics-tls-cert-file`, `--metrics-tls-key-file`): a scraper checking the CA gets the
operator's series and the certificate's expiry, a plaintext scrape gets nothing, and a
renewed pair written over the files (as the kubelet swaps a renewed Secret in) is served
from the next scrape on, without a restart. A pair given half, or one that does not
load, stops the operator at once with a line naming it.

A real API server (no kubelet): the operator runs as a process on the host, as in the
chart's Deployment."""

from __future__ import annotations

import datetime
import http.client
import shutil
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from e2e.certificates import ServingCertificates, issue_serving_certificates, not_valid_after, renew_serving_certificate
from e2e.operator_process import running_operator
from e2e.polling import wait_for
from tests.integration.scraping import samples, scrape_text, value
from tests.support.ports import free_port

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(120)]

EXPIRY = "shardq_tls_certificate_expiration_timestamp_seconds"
LOOPBACK = "127.0.0.1"
NAMES = {"dns_names": ["shardq-operator.test.svc"], "ip_addresses": [LOOPBACK]}


def published(pair: ServingCertificates, directory: Path) -> tuple[Path, Path]:
    """The pair copied to tls.crt / tls.key in `directory`, as a mounted Secret holds it."""
    directory.mkdir(exist_ok=True)
    cert, key = directory / "tls.crt", directory / "tls.key"
    shutil.copy(pair.key, key)
    shutil.copy(pair.cert, cert)
    return cert, key


def scraped_expiry(url: str, ca: Path) -> float | None:
    """The expiry the operator exports, or None while its metrics port does not answer."""
    try:
        return value(samples(scrape_text(url, ca_file=str(ca))), EXPIRY)
    except (urllib.error.URLError, ConnectionError, http.client.HTTPException):
        return None


def presented(port: int, ca: Path) -> bytes | None:
    """The certificate (DER) the metrics port shows a new connection, or None if none."""
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with (
            socket.create_connection((LOOPBACK, port), timeout=5) as connection,
            context.wrap_socket(connection, server_hostname=LOOPBACK) as secured,
        ):
            return secured.getpeercert(binary_form=True)
    except OSError:
        return None


def der(cert: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.read_text())


def test_metrics_are_served_over_https_with_the_expiry_and_follow_a_renewal(
    kubeconfig: Path, namespace: str, shardq_crds: list[str], tmp_path: Path
) -> None:
    issued = issue_serving_certificates(tmp_path / "issued", stem="first", **NAMES)  # type: ignore[arg-type]
    cert, key = published(issued, tmp_path / "mounted")
    port = free_port()
    url = f"https://{LOOPBACK}:{port}/metrics"
    log = tmp_path / "operator.log"
    tls = ["--metrics-tls-cert-file", str(cert), "--metrics-tls-key-file", str(key)]
    with running_operator(kubeconfig, namespace, log, metrics_port=port, extra_args=tls) as operator:
        wait_for(
            lambda: scraped_expiry(url, issued.ca) is not None or operator.poll() is not None,
            timeout=30,
            what="the operator's metrics over https",
        )
        assert operator.poll() is None, log.read_text()
        exposition = scrape_text(url, ca_file=str(issued.ca))
        assert "# TYPE shardq_operator_reconciles_total counter" in exposition  # the operator's own series
        assert value(samples(exposition), EXPIRY) == not_valid_after(issued.cert)
        assert presented(port, issued.ca) == der(issued.cert)

        # Plaintext gets no answer: the connection closes at the handshake.
        with pytest.raises((http.client.HTTPException, ConnectionError, urllib.error.URLError)):
            urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics", timeout=5).read()
        # A scraper without the CA refuses the certificate.
        with pytest.raises(urllib.error.URLError) as untrusted:
            scrape_text(url)
        assert isinstance(untrusted.value.reason, ssl.SSLCertVerificationError)

        renewed = renew_serving_certificate(
            issued,
            stem="renewed",
            validity=datetime.timedelta(days=200),
            **NAMES,  # type: ignore[arg-type]
        )
        assert not_valid_after(renewed.cert) != not_valid_after(issued.cert)
        published(renewed, tmp_path / "mounted")
        wait_for(
            lambda: presented(port, issued.ca) == der(renewed.cert),
            timeout=30,
            what="the renewed certificate served",
        )
        assert scraped_expiry(url, issued.ca) == not_valid_after(renewed.cert)
        assert operator.poll() is None, "the operator stopped during the renewal"


def operator_start(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """An operator started with `args`, which must stop by itself."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "shardq_operator",
            "--kubeconfig",
            str(kubeconfig),
            "--metrics-port",
            str(free_port()),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_a_pair_given_half_or_that_does_not_load_stops_the_start_naming_it(kubeconfig: Path, tmp_path: Path) -> None:
    issued = issue_serving_certificates(tmp_path, stem="one", **NAMES)  # type: ignore[arg-type]
    other = issue_serving_certificates(tmp_path, stem="other", **NAMES)  # type: ignore[arg-type]

    half = operator_start(kubeconfig, "--metrics-tls-cert-file", str(issued.cert))
    assert half.returncode == 2
    assert "--metrics-tls-cert-file and --metrics-tls-key-file go together" in half.stderr

    mismatched = operator_start(
        kubeconfig, "--metrics-tls-cert-file", str(issued.cert), "--metrics-tls-key-file", str(other.key)
    )
    assert mismatched.returncode == 1
    assert f"--metrics-tls-cert-file: {other.key} is not the private key of {issued.cert}" in mismatched.stderr

    missing = operator_start(
        kubeconfig, "--metrics-tls-cert-file", str(tmp_path / "absent.crt"), "--metrics-tls-key-file", str(issued.key)
    )
    assert missing.returncode == 1
    assert f"--metrics-tls-cert-file: cannot read {tmp_path / 'absent.crt'}" in missing.stderr
